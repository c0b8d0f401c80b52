"""`marathon bench parity`: how closely the vLLM plugin reproduces the HF model, per layer-type configuration.

For each configuration (tiny preset with the layout overridden: L-only, S-only, G-only, hybrid LSLG) and
dtype, one vLLM engine samples completions (temperature 1, logprob of each sampled token); the HF model with
the same weights and dtype recomputes those tokens' logprobs in one forward. Prints mean / max |diff| and
timings (engine start, generation, HF recompute).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

CONFIGS = {"L-only": "L", "S-only": "S", "G-only": "G", "hybrid": "LSLG"}
DTYPES = ("float32", "bfloat16")


def register(subparsers) -> None:
    p = subparsers.add_parser("parity", help="vLLM plugin vs HF logprob differences per layer type and dtype")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--prompts", type=int, default=4, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=80, help="prompt length (> sliding window and one chunk)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def measure(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """One engine on model_dir: sampled completions' logprobs vs the HF model's. Returns the row's figures."""
    import torch
    from vllm import LLM, SamplingParams

    from model.modeling import MarathonForCausalLM
    from rollout.vllm_plugin.model import serving_architecture

    hf = MarathonForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=True,
        seed=seed,
        hf_overrides={"architectures": [serving_architecture(hf.config)]},
    )
    t1 = time.perf_counter()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    t2 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    diffs = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        served = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(ids)])
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits.float(), dim=-1)[0]
        ref = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
        diffs.append((served - ref).abs())
    d = torch.cat(diffs)
    return {
        "tokens": d.numel(),
        "mean": d.mean().item(),
        "max": d.max().item(),
        "load_s": t1 - t0,
        "gen_s": t2 - t1,
        "hf_s": time.perf_counter() - t2,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from rollout.vllm_plugin.tiny import write_tiny_marathon

    names = args.configs.split(",")
    dtypes = args.dtypes.split(",")
    unknown = [n for n in names if n not in CONFIGS] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown config/dtype {unknown}; configs {list(CONFIGS)}, dtypes {list(DTYPES)}")
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 512, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    print(
        f"vLLM plugin vs HF: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} sampled tokens each "
        f"(temperature 1); |logprob diff| of the sampled tokens; tiny preset, 4 layers"
    )
    header = f"{'config':<8} {'layout':<6} {'dtype':<9} {'tokens':>6} {'mean|diff|':>11} {'max|diff|':>10} {'load s':>7} {'gen s':>6} {'hf s':>5}"
    print(header)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_dir = write_tiny_marathon(Path(tmp) / name, seed=args.seed, layer_layout=CONFIGS[name])
            for dtype in dtypes:
                r = measure(model_dir, dtype, prompts, args.new_tokens, args.seed)
                print(
                    f"{name:<8} {CONFIGS[name]:<6} {dtype:<9} {r['tokens']:>6} {r['mean']:>11.2e} {r['max']:>10.2e} "
                    f"{r['load_s']:>7.1f} {r['gen_s']:>6.2f} {r['hf_s']:>5.2f}",
                    flush=True,
                )
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0
