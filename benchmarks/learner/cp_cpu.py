"""Context parallelism on CPU: the longest episode a tiny-but-wide hybrid model trains (forward + backward of the
learner's logprob loss) under a fixed per-rank memory cap with CP = 1, 2, 4, and the time per token.

Each trial starts fresh gloo processes, one per CP rank (torch.multiprocessing, one intra-op thread each), builds
the model, warms up on a short row, then runs one forward + backward of a single episode of L tokens cut into
CP shards (`learner.context_parallel`), with gradient checkpointing and the token-chunked logprob head, and
sums the gradients over the group.

Memory trials: a rank's memory is its step's peak resident set above what it held before the step
(`ru_maxrss` - RSS before; fresh processes, so the peak is this step's): activations, recompute, gradients,
collectives' buffers. They run with glibc's mmap threshold fixed at 128 KiB, so every freed block over that
leaves the resident set at once and RSS follows the live tensors (by default the threshold rises after the
first frees and freed activations stay in the heap, inflating RSS by a varying amount). Lengths double from
--start until a rank passes the cap, then bisect in steps of --step tokens.

Time trials: the same step with the default allocator (the fixed threshold makes every large allocation a fresh
mmap, several times slower), at --same-length tokens on every CP degree and at each degree's longest length.

    python benchmarks/learner/cp_cpu.py                      # writes benchmarks/learner/cp_cpu.{json,md}
    python benchmarks/learner/cp_cpu.py --cap-mib 768 --start 2048 --same-length 4096

Wall time counts every rank's process on the machine's cores (2 on the project's machine: CP=4 runs 4 ranks on
2 cores, so its wall time per token is about twice what 4 cores would give); rank-seconds per token (the sum of
the ranks' step times over the tokens) is the work CP adds. Each trial records the machine's 1-minute load
average before and after: on a shared machine, read the times with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from learner.dist import free_port  # noqa: E402

# The tiny-but-wide model: Kimi Linear's 3 KDA : 1 gated MLA layout, hidden 512, MoE, block attention residuals.
MODEL = dict(
    vocab_size=512, hidden_size=512, num_hidden_layers=4, layer_layout="LLLG", linear_num_heads=4,
    linear_head_k_dim=64, linear_head_v_dim=64, mla_num_heads=4, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=256, attn_residual=True, attn_residual_block_size=2,
)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _episode(length: int, vocab: int):
    from learner.packing import Sample, collate

    ids = torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return collate([Sample(token_ids=ids, loss_mask=[1] * length, logprobs=[0.0] * length)], [0], packed=True)


def _step(model, cp, mb) -> float:
    from learner.logprobs import token_logprobs

    t = time.perf_counter()
    with cp.sharded(mb) as local:
        logp = token_logprobs(model, local, {"cu_seqlens"})
        (-logp.sum() / mb.num_loss_tokens).backward()
    cp.all_reduce_gradients()
    return time.perf_counter() - t


def _rank(rank: int, size: int, port: int, length: int, out: str) -> None:
    import torch.distributed as dist

    from learner.context_parallel import ContextParallel
    from model import MarathonConfig, MarathonForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", **MODEL)).float().train()
    model.gradient_checkpointing_enable()
    cp = ContextParallel(model)
    _step(model, cp, _episode(256 * size, model.config.vocab_size))  # warm-up: first-call allocations
    model.zero_grad(set_to_none=True)
    mb = _episode(length, model.config.vocab_size)
    before = _rss_mib()
    seconds = _step(model, cp, mb)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before  # ru_maxrss: KiB on Linux
    got = [None] * size
    dist.all_gather_object(got, {"rank": rank, "peak_mib": peak, "seconds": seconds})
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def trial(size: int, length: int, tmp: Path, memory: bool) -> dict:
    """One step of ``length`` tokens over ``size`` ranks; ``memory``: with the fixed mmap threshold."""
    import torch.multiprocessing as mp

    port = free_port()
    out = tmp / f"cp{size}-{length}.json"
    load = os.getloadavg()[0]
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if memory:  # read by glibc when each rank's process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    t = time.perf_counter()
    try:
        mp.spawn(_rank, args=(size, port, length, str(out)), nprocs=size, join=True)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    wall = time.perf_counter() - t
    ranks = json.loads(out.read_text())
    step = max(r["seconds"] for r in ranks)
    return {
        "kind": "memory" if memory else "time", "cp": size, "tokens": length,
        "peak_mib": max(r["peak_mib"] for r in ranks), "rank_peaks_mib": [round(r["peak_mib"], 1) for r in ranks],
        "step_s": step, "s_per_token": step / length, "rank_s_per_token": sum(r["seconds"] for r in ranks) / length,
        "process_wall_s": wall, "load_avg_1min": [load, os.getloadavg()[0]],  # the machine's load: before, after
    }


def longest(size: int, cap: float, start: int, step: int, tmp: Path, log) -> tuple[int, list[dict]]:
    """Double from ``start`` until a rank's peak passes ``cap``, then bisect down to ``step`` tokens."""
    runs, good, bad = [], 0, None
    length = start
    while bad is None:
        r = trial(size, length, tmp, memory=True)
        runs.append(r)
        log(r)
        if r["peak_mib"] <= cap:
            good, length = length, length * 2
        else:
            bad = length
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        r = trial(size, mid, tmp, memory=True)
        runs.append(r)
        log(r)
        good, bad = (mid, bad) if r["peak_mib"] <= cap else (good, mid)
    return good, runs


def _peaks(r: dict) -> str:
    return ", ".join(f"{p:.0f}" for p in r["rank_peaks_mib"])


def crossing(results: dict, size: int) -> float | None:
    """The length where the memory trials' peak reaches the cap, interpolated linearly between the longest
    length under it and the shortest over it (the search's resolution is --step tokens)."""
    mem = sorted((r["tokens"], r["peak_mib"]) for r in results["runs"] if r["kind"] == "memory" and r["cp"] == size)
    under = [m for m in mem if m[1] <= results["cap_mib"]]
    over = [m for m in mem if m[1] > results["cap_mib"]]
    if not under or not over:
        return None
    (t0, p0), (t1, p1) = under[-1], over[0]
    return t0 + (results["cap_mib"] - p0) / (p1 - p0) * (t1 - t0)


def render(results: dict) -> str:
    cap, runs = results["cap_mib"], results["runs"]
    timed = {(r["cp"], r["tokens"]): r for r in runs if r["kind"] == "time"}
    lines = [
        f"# Context parallelism on CPU: longest trainable episode under {cap:.0f} MiB per rank",
        "",
        f"Model: `{json.dumps(results['model'])}` ({results['params'] / 1e6:.1f}M parameters), fp32, gradient "
        "checkpointing, token-chunked logprob head; one episode per row, forward + backward + gradient sum over the "
        f"CP group. Machine: {results['machine']}. Command: `{results['command']}`.",
        "",
        "| CP | longest episode (tokens) | x CP=1 | cap crossed at (interpolated) | x CP=1 | peak MiB per rank "
        "(memory trial) | step s | wall ms / 1K tokens | rank-s / 1K tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base, base_x = results["longest"].get("1"), crossing(results, 1)
    for size, length in results["longest"].items():
        mem = next((r for r in runs if r["kind"] == "memory" and r["cp"] == int(size) and r["tokens"] == length), None)
        if mem is None:
            lines.append(f"| {size} | none under the cap | - | - | - | - | - | - | - |")
            continue
        t = timed.get((int(size), length))
        times = f"{t['step_s']:.1f} | {t['s_per_token'] * 1e6:.0f} | {t['rank_s_per_token'] * 1e3:.2f}" if t else "- | - | -"
        ratio = f"{length / base:.2f}" if base else "-"
        x = crossing(results, int(size))
        cross = f"{x:.0f} | {x / base_x:.2f}" if x and base_x else "- | -"
        lines.append(f"| {size} | {length} | {ratio} | {cross} | {_peaks(mem)} | {times} |")
    same = results.get("same_length")
    if same:
        lines += ["", f"The same episode ({same} tokens) on every CP degree (time trials):", "",
                  "| CP | step s | wall ms / 1K tokens | rank-s / 1K tokens |", "|---|---|---|---|"]
        for (size, length), r in sorted(timed.items()):
            if length == same:
                lines.append(f"| {size} | {r['step_s']:.1f} | {r['s_per_token'] * 1e6:.0f} | {r['rank_s_per_token'] * 1e3:.2f} |")
    if results.get("note"):
        lines += ["", results["note"]]
    lines += ["", "Every trial (peak = the largest rank's; load = the machine's 1-minute load average before / after; "
              "memory trials run with the fixed mmap threshold, so their times are not comparable):", "",
              "| kind | CP | tokens | peak MiB | step s | wall ms / 1K tokens | load |", "|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["kind"], r["cp"], r["tokens"])):
        load = "/".join(f"{x:.1f}" for x in r["load_avg_1min"])
        lines.append(f"| {r['kind']} | {r['cp']} | {r['tokens']} | {r['peak_mib']:.0f} | {r['step_s']:.1f} "
                     f"| {r['s_per_token'] * 1e6:.0f} | {load} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mib", type=float, default=256.0, help="per-rank step memory cap (MiB)")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--start", type=int, default=1024, help="first length tried (CP=c starts at c times it)")
    ap.add_argument("--step", type=int, default=512, help="bisection resolution (tokens)")
    ap.add_argument("--same-length", type=int, default=2048, help="also time every CP at this length (0: skip)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "learner"))
    ap.add_argument("--render", action="store_true", help="only rewrite cp_cpu.md from cp_cpu.json")
    ap.add_argument("--time-only", action="store_true",
                    help="keep the memory trials of cp_cpu.json and (re)run only the time trials")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render:
        (out / "cp_cpu.md").write_text(render(json.loads((out / "cp_cpu.json").read_text())))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from model import MarathonConfig, MarathonForCausalLM

    params = sum(p.numel() for p in MarathonForCausalLM(MarathonConfig.from_preset("tiny", **MODEL)).parameters())
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".cp_cpu_tmp"
    tmp.mkdir(exist_ok=True)
    results = {"cap_mib": args.cap_mib, "model": MODEL, "params": params, "machine": f"{os.cpu_count()} CPU cores",
               "command": " ".join(["python benchmarks/learner/cp_cpu.py", *sys.argv[1:]]), "longest": {}, "runs": []}

    def log(r):
        print(f"{r['kind']} CP={r['cp']} L={r['tokens']}: peak {r['peak_mib']:.0f} MiB ({r['rank_peaks_mib']}), "
              f"step {r['step_s']:.1f} s, {r['s_per_token'] * 1e6:.0f} us/token, load {r['load_avg_1min']}", flush=True)

    def save():
        (out / "cp_cpu.json").write_text(json.dumps(results, indent=1))
        (out / "cp_cpu.md").write_text(render(results))

    sizes = [int(c) for c in args.cps.split(",")]
    if args.time_only:
        kept = json.loads((out / "cp_cpu.json").read_text())
        results.update(longest=kept["longest"], note=kept.get("memory_note"), memory_note=kept.get("memory_note"),
                       runs=[r for r in kept["runs"] if r["kind"] == "memory"],
                       command=f"{kept['command']}, then {results['command']}")
    for size in sizes if not args.time_only else []:
        length, runs = longest(size, args.cap_mib, args.start * size, args.step, tmp, log)
        results["longest"][str(size)] = length
        results["runs"] += runs
        print(f"CP={size}: longest {length} tokens under {args.cap_mib:.0f} MiB", flush=True)
        save()
    results["same_length"] = args.same_length or None
    for size in sizes:
        for length in sorted({args.same_length, results["longest"][str(size)]} - {0}):
            r = trial(size, length, tmp, memory=False)
            log(r)
            results["runs"].append(r)
            save()
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    print(render(results))


if __name__ == "__main__":
    main()
