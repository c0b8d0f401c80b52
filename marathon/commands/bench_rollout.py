"""`marathon bench rollout`: generated tokens/s of the Ray + vLLM rollout path (``RolloutWorker`` actors) versus
plain HF ``generate`` (one prompt at a time, and all prompts as one left-padded batch), on the same model, the
same chat prompts (opening turns of a built-in env) and the same number of new tokens per prompt, in one run.
Prints a table; writes results.md under ``--out``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("rollout", help="generated tokens/s: Ray + vLLM workers vs HF generate")
    parser.add_argument("--model", help="HF checkpoint dir (default: a fresh tiny random Qwen3)")
    parser.add_argument("--env", default="marathon/Arithmetic-v0", help="env whose opening prompts are used")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="Ray rollout workers (prompts split among them)")
    parser.add_argument("--cpus-per-worker", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="benchmarks/rollout")
    parser.set_defaults(func=main)


def chat_prompts(model_dir: str, env_id: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    import envs
    from rollout.chat import ChatCodec

    codec = ChatCodec(AutoTokenizer.from_pretrained(model_dir))
    env = envs.make(env_id)
    prompts = []
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        prompts.append(codec.prompt_ids(obs["messages"], obs.get("tools")))
    return prompts


def time_hf(model_dir: str, dtype: str, prompts: list[list[int]], new_tokens: int, batched: bool) -> tuple[float, int]:
    """Seconds and generated tokens for HF sampling of ``new_tokens`` per prompt (eos ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id or 0
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=pad)

    def run(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)  # [B, width + new_tokens]
        return (out.shape[1] - width) * len(batch)

    run(prompts[:1])  # warm-up
    t0 = time.perf_counter()
    tokens = run(prompts) if batched else sum(run([p]) for p in prompts)
    return time.perf_counter() - t0, tokens


def time_ray_vllm(model_dir: str, dtype: str, prompts: list[list[int]], new_tokens: int, workers: int, cpus: int) -> tuple[float, int, float]:
    """Seconds and generated tokens for one batched ``generate`` call per worker; plus the engines' start-up."""
    import ray

    from rollout.worker import GenRequest, WorkerConfig, spawn_worker

    max_len = max(map(len, prompts)) + new_tokens
    ray.init(num_cpus=workers * cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        t0 = time.perf_counter()
        cfg = WorkerConfig(model=model_dir, dtype=dtype, max_model_len=max_len, enable_prefix_caching=False)
        actors = [spawn_worker(cfg, num_cpus=cpus, max_restarts=0) for _ in range(workers)]
        ray.get([a.ready.remote() for a in actors])
        startup = time.perf_counter() - t0
        reqs = [GenRequest(f"p{i}", p, new_tokens, seed=i, ignore_eos=True) for i, p in enumerate(prompts)]
        ray.get([a.generate.remote(reqs[:1]) for a in actors])  # warm-up
        t0 = time.perf_counter()
        outs = ray.get([a.generate.remote(reqs[w::workers]) for w, a in enumerate(actors)])
        seconds = time.perf_counter() - t0
        return seconds, sum(len(r.token_ids) for batch in outs for r in batch), startup
    finally:
        ray.shutdown()


def main(args: argparse.Namespace) -> int:
    import torch

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from marathon.tiny import write_tiny_qwen3

            model_dir = str(write_tiny_qwen3(Path(tmp) / "tiny-qwen3"))
        prompts = chat_prompts(model_dir, args.env, args.prompts)
        n, new = len(prompts), args.max_new_tokens
        rows = []
        s, tok, startup = time_ray_vllm(model_dir, args.dtype, prompts, new, args.workers, args.cpus_per_worker)
        rows.append((f"Ray + vLLM, {args.workers} worker(s) x {args.cpus_per_worker} CPUs, one batched call each", s, tok))
        torch.set_num_threads(args.workers * args.cpus_per_worker)
        s, tok = time_hf(model_dir, args.dtype, prompts, new, batched=True)
        rows.append((f"HF generate, all {n} prompts in one left-padded batch", s, tok))
        s, tok = time_hf(model_dir, args.dtype, prompts, new, batched=False)
        rows.append(("HF generate, one prompt at a time", s, tok))

    cmd = shlex.join(["marathon", "bench", *sys.argv[2:]]) if len(sys.argv) > 2 else "marathon bench rollout"
    base = rows[-1][2] / rows[-1][1]
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Model: {args.model or 'tiny random Qwen3 (marathon/tiny.py: 2 layers, hidden 128, vocab 512)'}, {args.dtype}; "
        f"{n} chat prompts from {args.env} (lengths {min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{new} sampled tokens each (eos ignored), temperature 1; torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs on the machine, shared: 1-min load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end. Engine start-up (not in the timings): {startup:.1f} s.",
        "",
        "| path | seconds | generated tokens | tokens/s | vs HF one at a time |",
        "|---|---|---|---|---|",
        *[f"| {name} | {s:.2f} | {tok} | {tok / s:.0f} | {tok / s / base:.1f}x |" for name, s, tok in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    return 0
