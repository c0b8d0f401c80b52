"""One MoE layer of the ``learner-bench`` preset (hidden 2048, 32 experts top-4 + 1 shared, expert width 512), forward
+ backward on one packed row, with the MoE's gather-sums as PyTorch ops ("torch") and as the one-pass Triton kernel
("triton", `kernels.gather_sum`): the two alternate in one process, on the same routed inputs, and each time is the
median of ``--reps`` CUDA-event timings (after a warm-up that compiles the token-local methods as the learner does).
The gather-sum alone (the combine at the same shape, forward and backward) is timed the same way.

    python3 benchmarks/model/moe_layer.py --tokens 65536 --out moe-layer        # on the GPU machine
    python3 benchmarks/model/moe_layer.py --tokens 512 --reps 2 --out /tmp/moe  # CPU: runs the code, times nothing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels  # noqa: E402
from learner.compile import compile_token_local  # noqa: E402
from model.config import MarathonConfig  # noqa: E402
from model.moe import MoE  # noqa: E402

PATHS = ("torch", "triton")


def timed(fn, device) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn()`` -> a tensor, backward with a fixed cotangent."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    ev[0].record()
    out = fn()
    ev[1].record()
    out.backward(torch.ones_like(out))
    ev[2].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="leave the token-local methods eager")
    ap.add_argument("--out", type=Path, default=Path("moe-layer"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = MarathonConfig.from_preset("learner-bench")
    torch.manual_seed(0)
    moe = MoE(cfg).to(device, dtype).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if not args.no_compile:
        compile_token_local(moe)
    N, D, k = args.tokens, cfg.hidden_size, cfg.num_experts_per_tok
    x = (torch.randn(1, N, D, device=device) * 0.5).to(dtype).requires_grad_()
    y = torch.randn(N * k, D, device=device).to(dtype).requires_grad_()
    index = torch.randperm(N * k, device=device)
    w = torch.rand(N, k, device=device).requires_grad_()
    cases = {"layer": lambda: moe(x)[0], "gather_sum": lambda: kernels.gather_sum(y, index, k, w)}
    times = {c: {p: {"fwd": [], "bwd": []} for p in PATHS} for c in cases}
    for rep in range(args.reps + 1):  # rep 0: warm-up (compiles)
        for path in PATHS:
            kernels.GATHER_SUM_CUDA = path
            for case, fn in cases.items():
                f, b = timed(fn, device)
                moe.router.discard_pending()
                if rep:
                    times[case][path]["fwd"].append(f)
                    times[case][path]["bwd"].append(b)
    rows = [{"case": c, "path": p, "fwd_ms": statistics.median(t["fwd"]), "bwd_ms": statistics.median(t["bwd"])}
            for c, by in times.items() for p, t in by.items()]
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = {"device": device_name, "torch": torch.__version__, "tokens": N, "reps": args.reps,
            "compiled": not args.no_compile, "dtype": str(dtype)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{device_name}, torch {torch.__version__}, {N} tokens, {dtype}, median of {args.reps}", "",
             "| case | gather-sums | fwd ms | bwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['path']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_ms'] + r['bwd_ms']:.2f} |"
              for r in rows]
    (args.out / "moe_layer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
