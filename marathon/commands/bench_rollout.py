"""`marathon bench rollout`: generated tokens/s of the Ray + vLLM rollout path (``RolloutWorker`` actors) versus
plain HF ``generate`` (one prompt at a time, and all prompts as one left-padded batch), on the same model, the
same chat prompts (opening turns of a built-in env) and the same number of new tokens per prompt, in one run.
Prints a table; writes results.md under ``--out``."""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _tiny_qwen3(path: Path) -> Path:
    from marathon.tiny import write_tiny_qwen3

    return write_tiny_qwen3(path)


def _tiny_marathon(path: Path) -> Path:
    from rollout.vllm_plugin.tiny import write_tiny_marathon

    return write_tiny_marathon(path)


TINY = {"tiny-qwen3": _tiny_qwen3, "tiny-marathon": _tiny_marathon}
TINY_DOC = {
    "tiny-qwen3": "tiny random Qwen3 (marathon/tiny.py: 2 layers, hidden 128, vocab 512)",
    "tiny-marathon": "tiny random MarathonForCausalLM (rollout/vllm_plugin/tiny.py: preset tiny, served by our plugin)",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("rollout", help="generated tokens/s: Ray + vLLM workers vs HF generate")
    parser.add_argument("--model", default="tiny-qwen3",
                        help="HF checkpoint dir, or tiny-qwen3 / tiny-marathon (a fresh tiny random model)")
    parser.add_argument("--env", default="marathon/Arithmetic-v0", help="env whose opening prompts are used")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="Ray rollout workers (prompts split among them)")
    parser.add_argument("--cpus-per-worker", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
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


class HFPath:
    """Plain HF ``generate``: sampling ``new_tokens`` per prompt (eos ignored), one prompt at a time or batched."""

    def __init__(self, model_dir: str, dtype: str, new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        import model  # noqa: F401 - registers MarathonForCausalLM with transformers' Auto classes

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.pad = self.model.config.pad_token_id or 0
        self.kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=self.pad)

    def generate(self, batch: list[list[int]]) -> int:
        import torch

        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **self.kw)  # [B, width + new_tokens]
        return (out.shape[1] - width) * len(batch)

    def batched(self, prompts: list[list[int]]) -> int:
        return self.generate(prompts)

    def one_at_a_time(self, prompts: list[list[int]]) -> int:
        return sum(self.generate([p]) for p in prompts)


class RayVLLMPath:
    """``RolloutWorker`` actors: the prompts split among them, one batched ``generate`` call each."""

    def __init__(self, model_dir: str, dtype: str, max_len: int, new_tokens: int, workers: int, cpus: int) -> None:
        import ray

        from rollout.worker import WorkerConfig, spawn_worker

        ray.init(num_cpus=workers * cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        t0 = time.perf_counter()
        cfg = WorkerConfig(model=model_dir, dtype=dtype, max_model_len=max_len, enable_prefix_caching=False)
        self.actors = [spawn_worker(cfg, num_cpus=cpus, max_restarts=0) for _ in range(workers)]
        ray.get([a.ready.remote() for a in self.actors])
        self.startup = time.perf_counter() - t0
        self.new_tokens = new_tokens

    def sync_weights(self, state: dict) -> tuple[float, float]:
        """(MiB, seconds) of one weight update of every worker through the object store (``WorkerPool``)."""
        from rollout.runner import WorkerPool

        t0 = time.perf_counter()
        WorkerPool(self.actors).update_weights(state, version=1)
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in state.values()}  # tied tensors once
        return sum(sizes.values()) / 2**20, time.perf_counter() - t0

    def run(self, prompts: list[list[int]]) -> int:
        import ray

        from rollout.worker import GenRequest

        reqs = [GenRequest(f"p{i}", p, self.new_tokens, seed=i, ignore_eos=True) for i, p in enumerate(prompts)]
        n = len(self.actors)
        outs = ray.get([a.generate.remote(reqs[w::n]) for w, a in enumerate(self.actors)])
        return sum(len(r.token_ids) for batch in outs for r in batch)


def main(args: argparse.Namespace) -> int:
    import ray
    import torch

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.workers * args.cpus_per_worker)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir in TINY:
            model_dir = str(TINY[model_dir](Path(tmp) / model_dir))
        prompts = chat_prompts(model_dir, args.env, args.prompts)
        n, new = len(prompts), args.max_new_tokens
        vllm = RayVLLMPath(model_dir, args.dtype, max(map(len, prompts)) + new, new, args.workers, args.cpus_per_worker)
        hf = HFPath(model_dir, args.dtype, new)
        paths = {
            f"Ray + vLLM, {args.workers} worker(s) x {args.cpus_per_worker} CPUs, one batched call each": vllm.run,
            f"HF generate, all {n} prompts in one left-padded batch": hf.batched,
            "HF generate, one prompt at a time": hf.one_at_a_time,
        }
        for run in paths.values():  # warm-up
            run(prompts[:1])
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):  # interleaved, so load changes on the shared machine hit every path
            for name, run in paths.items():
                t0 = time.perf_counter()
                tokens[name] = run(prompts)
                seconds[name].append(time.perf_counter() - t0)
        sync = vllm.sync_weights(hf.model.state_dict())
        ray.shutdown()

    cmd = shlex.join(["marathon", "bench", *sys.argv[2:]]) if len(sys.argv) > 2 else "marathon bench rollout"
    best = {name: min(s) for name, s in seconds.items()}
    base = tokens["HF generate, one prompt at a time"] / best["HF generate, one prompt at a time"]
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Model: {TINY_DOC.get(args.model, args.model)}, {args.dtype}; "
        f"{n} chat prompts from {args.env} (lengths {min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{new} sampled tokens each (eos ignored), temperature 1; torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs on the machine, shared: 1-min load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end. {args.repeats} interleaved repeats; tokens/s from the best one. "
        f"Engine start-up (not in the timings): {vllm.startup:.1f} s. Weight sync of all workers "
        f"(`WorkerPool.update_weights`, {sync[0]:.1f} MiB): {sync[1]:.2f} s.",
        "",
        "| path | generated tokens | seconds (best / median) | tokens/s | vs HF one at a time |",
        "|---|---|---|---|---|",
        *[f"| {name} | {tokens[name]} | {best[name]:.2f} / {statistics.median(s):.2f} | {tokens[name] / best[name]:.0f} "
          f"| {tokens[name] / best[name] / base:.1f}x |" for name, s in seconds.items()],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    return 0
