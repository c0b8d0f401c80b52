"""`marathon bench rollout`: rollout throughput, two ways.

``--mode tokens`` (the default): generated tokens/s of the Ray + vLLM rollout path (``RolloutWorker`` actors)
versus plain HF ``generate`` (one prompt at a time, and all prompts as one left-padded batch), on the same model,
the same chat prompts (opening turns of a built-in env) and the same number of new tokens per prompt, in one run.
Writes results.md under ``--out``.

``--mode sync,async`` (or one of them): whole multi-turn episodes on an env (default the heavy-tailed
``marathon/HeavyTail-v0``), the same episodes (env seeds) and config for each mode, side by side in one run.
``sync`` is the lock-step path of a sync RL loop: batches of ``--batch`` episodes (one RL step's worth), each
run by ``EpisodeRunner`` (all pending turns of a worker in one engine call, envs stepped when it returns), the
next batch after the slowest episode of the previous one. ``async`` keeps ``--batch`` episodes in flight on
``AsyncRolloutWorker`` (vLLM's async engine, one coroutine per episode, envs beside the engine) and starts the
next episode as soon as one ends. Reports episodes/s, generated tokens/s, the engine's idle fraction (wall time
with no request in the engine) and vLLM's prefix-cache hit rate (prompt tokens of later turns served from the
cache); writes episodes.md and episodes.json under ``--out``. Engine start-up is not timed; each mode's
engine runs alone."""

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
    parser = subparsers.add_parser("rollout", help="rollout throughput: vLLM vs HF generate (tokens), or whole "
                                   "episodes sync vs async (--mode sync,async)")
    parser.add_argument("--mode", default="tokens",
                        help="tokens (vLLM vs HF generate), or sync / async / sync,async (whole episodes)")
    parser.add_argument("--model", default=None,
                        help="HF checkpoint dir, or tiny-qwen3 / tiny-marathon (a fresh tiny random model); default "
                        "tiny-qwen3 for --mode tokens, tiny-marathon for episodes")
    parser.add_argument("--env", default=None, help="env: its opening prompts (tokens; default "
                        "marathon/Arithmetic-v0) or its episodes (sync/async; default marathon/HeavyTail-v0)")
    parser.add_argument("--env-kwargs", default="{}", help="episodes: env options as JSON, e.g. '{\"difficulty\": \"bench\"}'")
    parser.add_argument("--episodes", type=int, default=256, help="episodes: how many (env seeds 0..N-1)")
    parser.add_argument("--batch", type=int, default=64, help="episodes: per sync batch = in flight for async")
    parser.add_argument("--max-context", type=int, default=2048, help="episodes: tokens per episode")
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
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if modes == ["tokens"]:
        args.model, args.env = args.model or "tiny-qwen3", args.env or "marathon/Arithmetic-v0"
        return tokens_main(args)
    if not modes or set(modes) - {"sync", "async"}:
        print(f"--mode must be tokens, sync, async or sync,async; got {args.mode!r}", file=sys.stderr)
        return 2
    args.model, args.env = args.model or "tiny-marathon", args.env or "marathon/HeavyTail-v0"
    return episodes_main(args, modes)


def _episode_run(mode: str, model_dir: str, args: argparse.Namespace, specs: list, rollout) -> dict:
    """One mode on fresh workers: (stats of) all ``specs`` run to the end, timed after engine start-up."""
    import ray

    from rollout.async_worker import AsyncRolloutWorker, EpisodeStream
    from rollout.chat import ChatCodec
    from rollout.runner import EpisodeRunner, EpisodeSpec, WorkerPool
    from rollout.worker import RolloutWorker, WorkerConfig, spawn_worker

    cfg = WorkerConfig(model=model_dir, dtype=args.dtype, max_model_len=args.max_context, enable_prefix_caching=True,
                       max_num_seqs=max(256, args.batch))
    cls = AsyncRolloutWorker if mode == "async" else RolloutWorker
    t0 = time.perf_counter()
    actors = [spawn_worker(cfg, cls=cls, num_cpus=args.cpus_per_worker, max_restarts=0) for _ in range(args.workers)]
    ray.get([a.ready.remote() for a in actors])
    startup = time.perf_counter() - t0
    pool = WorkerPool(actors)
    codec = None
    if mode == "sync":
        from transformers import AutoTokenizer

        codec = ChatCodec(AutoTokenizer.from_pretrained(model_dir))
    warm = [EpisodeSpec(f"warm{i}", s.env_id, 10_000 + i, s.env_kwargs) for i, s in enumerate(specs[:4])]
    if mode == "sync":
        EpisodeRunner(pool, codec, rollout).run(warm)
    else:
        ray.get([a.run.remote(warm, rollout) for a in actors])
    before = ray.get([a.stats.remote() for a in actors])
    t0 = time.perf_counter()
    trajs = []
    if mode == "sync":  # one RL step's batch after another; each waits for its slowest episode
        for lo in range(0, len(specs), args.batch):
            trajs += EpisodeRunner(pool, codec, rollout).run(specs[lo : lo + args.batch])
    else:  # --batch episodes in flight; a new one starts as soon as one ends
        stream = EpisodeStream(pool, rollout, take_wait_s=0.2)
        nxt = min(args.batch, len(specs))
        stream.submit(specs[:nxt])
        while stream.outstanding:
            done = stream.poll(timeout_s=0.5)
            trajs += done
            if nxt < len(specs) and done:
                more = specs[nxt : nxt + len(done)]
                stream.submit(more)
                nxt += len(more)
    wall = time.perf_counter() - t0
    after = ray.get([a.stats.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    delta = {k: sum(b[k] - a[k] for a, b in zip(before, after))
             for k in ("busy_s", "prompt_tokens", "cached_tokens", "generated_tokens", "requests")}
    model_tokens = sum(t.num_model_tokens for t in trajs)
    return {
        "mode": mode, "episodes": len(trajs), "wall_s": wall, "startup_s": startup,
        "episodes_per_s": len(trajs) / wall, "gen_tokens_per_s": model_tokens / wall,
        "engine_idle_frac": 1 - delta["busy_s"] / (wall * len(actors)),
        "turns": sum(t.num_turns for t in trajs), "model_tokens": model_tokens,
        "prefix_cache_hit": delta["cached_tokens"] / max(delta["prompt_tokens"], 1),
        "prompt_tokens": delta["prompt_tokens"], "cached_tokens": delta["cached_tokens"],
        "engine_requests": delta["requests"], "truncated": sum(t.truncated for t in trajs),
    }


def episodes_main(args: argparse.Namespace, modes: list[str]) -> int:
    import json

    import numpy as np
    import ray

    import envs
    from rollout.runner import EpisodeSpec, RolloutConfig

    load_before = os.getloadavg()[0]
    env_kwargs = json.loads(args.env_kwargs)
    specs = [EpisodeSpec(f"b{i}", args.env, seed=i, env_kwargs=env_kwargs) for i in range(args.episodes)]
    env = envs.make(args.env, **env_kwargs)
    shape = [env.reset(seed=s.seed)[1] for s in specs]
    env.close()
    turns = [i["num_questions"] for i in shape if "num_questions" in i]
    digits = [d for i in shape for d in i.get("answer_digits", [])]
    rollout = RolloutConfig(max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    ray.init(num_cpus=args.workers * args.cpus_per_worker, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(TINY[args.model](Path(tmp) / args.model)) if args.model in TINY else args.model
        for mode in modes:
            results.append(_episode_run(mode, model_dir, args, specs, rollout))
            print(json.dumps(results[-1]), flush=True)
    ray.shutdown()

    cmd = shlex.join(["marathon", "bench", *sys.argv[2:]]) if len(sys.argv) > 2 else "marathon bench rollout"
    by = {r["mode"]: r for r in results}
    speedup = (f" Async / sync: {by['async']['episodes_per_s'] / by['sync']['episodes_per_s']:.2f}x episodes/s, "
               f"{by['async']['gen_tokens_per_s'] / by['sync']['gen_tokens_per_s']:.2f}x generated tokens/s."
               if len(by) == 2 else "")
    dist = (f" Task shape over these seeds: turns {min(turns)}-{max(turns)} (median {np.median(turns):g}), answer "
            f"digits {min(digits)}-{max(digits)} (median {np.median(digits):g})." if turns else "")
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Model: {TINY_DOC.get(args.model, args.model)}, {args.dtype}; env {args.env} {env_kwargs or ''}, "
        f"{len(specs)} episodes (env seeds 0-{len(specs) - 1}), batch {args.batch} (sync: episodes per step, async: "
        f"in flight), at most {args.max_new_tokens} tokens per turn (the env's per-question budget applies), "
        f"{args.max_context} per episode, temperature 1.{dist} {args.workers} worker(s) x {args.cpus_per_worker} "
        f"CPUs; {os.cpu_count()} CPUs on the machine, shared: 1-min load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end.{speedup}",
        "",
        "| mode | episodes | wall s | episodes/s | generated tokens/s | engine idle | prefix-cache hit (prompt tokens) "
        "| engine requests | start-up s |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['mode']} | {r['episodes']} | {r['wall_s']:.1f} | {r['episodes_per_s']:.2f} | "
          f"{r['gen_tokens_per_s']:.0f} | {r['engine_idle_frac']:.1%} | {r['prefix_cache_hit']:.1%} "
          f"({r['cached_tokens']} of {r['prompt_tokens']}) | {r['engine_requests']} | {r['startup_s']:.0f} |"
          for r in results],
        "",
    ]
    return _report(lines, args.out, {"episodes.md": None,
                                     "episodes.json": json.dumps({"command": cmd, "results": results}, indent=2)})


def tokens_main(args: argparse.Namespace) -> int:
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
    return _report(lines, args.out, {"results.md": None})


def _report(lines: list[str], out_dir: str, files: dict[str, str | None]) -> int:
    """Print the report and write it under ``out_dir``: each file gets its text (None: the report itself)."""
    text = "\n".join(lines)
    print(text)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (out / name).write_text(text if body is None else body)
    return 0
