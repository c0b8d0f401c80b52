"""Where the time goes: per-kernel CUDA times of our chunked KDA kernel and fla's ``chunk_kda``
(torch.profiler), the launch configs our autotuned kernels chose, and the error of every output and
gradient of ours (bf16 and fp32), fla's and the chunked PyTorch path (bf16) against an fp64 reference.

Run on the GPU machine from the repo root (fla-core carried as a wheel, see run_all.sh):

    python3 benchmarks/kernels/breakdown.py --tokens 65536 --check-tokens 4096 --out $OUT

``--compare DIR`` also times and checks an earlier revision's kernels in the same process (``ours_before``): DIR
holds that revision's ``kernels/`` tree, e.g. ``git archive REV kernels | tar -x -C .before`` made where git is
(``benchmarks/learner/run_gpu.sh ab`` carries ``.before``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import gated_delta_triton as gdt  # noqa: E402
from marathon.commands.bench_kernels import (_inputs, _packed_lengths, _rel, kda_check_case,  # noqa: E402
                                             kda_outputs_and_grads)

NAMES = ["o", "ht", "dq", "dk", "dv", "dgate", "dbeta", "dh0"]


V1 = None  # an earlier revision's kernels.gated_delta_triton to compare against (--compare DIR)


def load_before(tree: Path):
    """The ``gated_delta_triton`` package of the ``kernels/`` tree under ``tree``, imported as
    ``kernels_before.gated_delta_triton`` (its own imports of ``kernels.`` rewritten) beside this tree's."""
    root = Path(tempfile.mkdtemp(prefix="kernels-before-"))
    shutil.copytree(tree / "kernels", root / "kernels_before")
    for f in (root / "kernels_before").rglob("*.py"):
        f.write_text(re.sub(r"\b(from|import) kernels\.", r"\1 kernels_before.", f.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("kernels_before.gated_delta_triton")


def methods(have_fla: bool) -> dict:
    out = {"ours": lambda q, k, v, raw, beta, **kw: gdt.chunk_gated_delta_rule_triton(
        q, k, v, raw, beta, gate_lower_bound=-5.0, **kw)}
    if V1 is not None:
        out["ours_before"] = lambda q, k, v, raw, beta, **kw: V1.chunk_gated_delta_rule_triton(
            q, k, v, raw, beta, gate_lower_bound=-5.0, **kw)
    if have_fla:
        from fla.ops.kda import chunk_kda

        out["fla"] = lambda q, k, v, raw, beta, **kw: chunk_kda(
            q, k, v, raw, beta, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, **kw)
    return out


def kernel_table(fn, iters: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, device us per iteration, launches per iteration), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[e.name] += 1
    rows = [(n, t / iters, count[n] // iters) for n, t in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def profile_methods(T: int, have_fla: bool, packed: bool = False, heads: int = 16, head_dim: int = 128,
                    dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> dict:
    """Each method on ``batch`` rows of T tokens; with ``packed`` (batch 1) also on the same row cut into the kernel
    table's ragged episodes (``bench_kernels._packed_lengths``), as ``<method>_packed``."""
    if packed and batch != 1:
        raise ValueError("--packed profiles one row: leave --batch at 1")
    q, k, v, raw, beta = [t.requires_grad_() for t in _inputs(batch, T, heads, head_dim, dtype)]
    do = torch.randn_like(v)
    cu = torch.tensor([0, *torch.tensor(_packed_lengths(T)).cumsum(0).tolist()], device="cuda")
    cases = [(name, fn, {}) for name, fn in methods(have_fla).items()]
    if packed:
        cases += [(name + "_packed", fn, {"cu_seqlens": cu}) for name, fn, _ in cases]
    res = {}
    for name, fn, kw in cases:
        def fwd(fn=fn, kw=kw):
            with torch.no_grad():
                fn(q, k, v, raw, beta, **kw)

        def step(fn=fn, kw=kw):
            o = fn(q, k, v, raw, beta, **kw)[0]
            torch.autograd.grad(o, (q, k, v, raw, beta), do)

        res[name] = {"fwd_ms": triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median"),
                     "fwd_bwd_ms": triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")}
        try:
            res[name]["kernels"] = kernel_table(step)
        except Exception as e:  # the profiler needs CUPTI; timings above stand without it
            res[name]["kernels"] = f"profiler failed: {e!r}"
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "kernels"}), flush=True)
        if isinstance(res[name]["kernels"], list):
            for n, us, c in res[name]["kernels"]:
                print(f"  {us:9.1f} us  x{c:<3d} {n[:110]}", flush=True)
        torch.cuda.empty_cache()
    return res


def tuned_configs() -> dict:
    """The launch configs our autotuned kernels picked (after a run)."""
    return {name: str(getattr(gdt, name).best_config) for name in ("_state_fwd_kernel", "_state_bwd_kernel",
                                                                   "_bwd_state_side_kernel", "_bwd_pair_kernel")
            if getattr(getattr(gdt, name), "best_config", None) is not None}


def accuracy(T: int, heads: int, have_fla: bool, head_dim: int = 128) -> dict:
    """Norm-relative error of each output and gradient against the chunked path in fp64 on the same rounded
    inputs (fp32 initial state): each method in bf16 and fp32 (fla's fp32 dots are TF32), ours in fp32 also at
    float32 matmul precision "high" (``ours_tf32``: one TF32 product per dot, like fla's), and the chunked PyTorch
    path in bf16. fp32 rows see fp32 inputs, bf16 rows the same inputs rounded to bf16."""
    from kernels.chunked_gated_delta import chunk_gated_delta_rule

    case = kda_check_case(1, T, heads, head_dim)
    res = {}
    cands = {f"{name}_{dt}": (fn, dt) for dt in ("bf16", "fp32") for name, fn in methods(have_fla).items()}
    cands = {**cands, "ours_tf32": (cands["ours_fp32"][0], "tf32"), "torch_chunked_bf16": (None, "bf16")}
    refs = {}
    for name, (fn, dt) in cands.items():
        x = [t.to(torch.bfloat16) if dt == "bf16" else t for t in case[0]]
        rounded = dt == "bf16"  # the fp64 reference on bf16-rounded or on fp32 inputs
        if rounded not in refs:
            refs[rounded] = kda_outputs_and_grads(chunk_gated_delta_rule, case, x, torch.float64, False)
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        try:
            with gdt.float32_matmul_precision("high" if dt == "tf32" else "highest"):
                if fn is None:
                    out = kda_outputs_and_grads(chunk_gated_delta_rule, case, x, dtype, False)
                else:
                    out = kda_outputs_and_grads(fn, case, x, dtype, True)
            res[name] = {n: _rel(a, b) for n, a, b in zip(NAMES, out, refs[rounded])}
        except Exception as e:
            res[name] = {"error": repr(e)[:300]}
        print(name, json.dumps(res[name]), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per row of the profiled rows")
    p.add_argument("--batch", type=int, default=1, help="rows profiled at once (4 at the kernel table's first shape)")
    p.add_argument("--heads", type=int, default=16, help="heads of the profiled row")
    p.add_argument("--head-dim", type=int, default=128, help="K = V of the profiled row")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="inputs of the profiled row")
    p.add_argument("--check-tokens", type=int, default=4096)
    p.add_argument("--check-heads", type=int, default=16, help="fla autotunes per head count: keep it at 16")
    p.add_argument("--check-head-dim", type=int, default=128, help="K = V of the accuracy check")
    p.add_argument("--skip", default="", help="comma list of: profile, accuracy")
    p.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out")
    p.add_argument("--packed", action="store_true", help="also profile each method on the row cut into ragged episodes")
    p.add_argument("--compare", help="a folder holding an earlier revision's kernels/ tree: its kernels are timed "
                   "and checked too (ours_before)")
    p.add_argument("--out", default="benchmarks/kernels")
    a = p.parse_args()
    if a.compare:
        global V1
        V1 = load_before(Path(a.compare))
    try:
        import fla  # noqa: F401

        have_fla = not a.no_fla
    except ImportError:
        have_fla = False
    skip = set(a.skip.split(","))
    res = {"device": torch.cuda.get_device_name(), "batch": a.batch, "tokens": a.tokens, "heads": a.heads,
           "head_dim": a.head_dim, "dtype": a.dtype, "have_fla": have_fla}
    t0 = time.time()
    if "profile" not in skip:
        res["profile"] = profile_methods(a.tokens, have_fla, a.packed, a.heads, a.head_dim,
                                         torch.bfloat16 if a.dtype == "bf16" else torch.float32, a.batch)
        print(f"profile done {time.time() - t0:.0f}s", flush=True)
        save(res, a.out)
    if "accuracy" not in skip:
        res["accuracy"] = accuracy(a.check_tokens, a.check_heads, have_fla, a.check_head_dim)
        print(f"accuracy done {time.time() - t0:.0f}s", flush=True)
        save(res, a.out)
    res["tuned"] = tuned_configs()
    print("tuned", json.dumps(res["tuned"]), flush=True)
    save(res, a.out)
    return 0


def save(res: dict, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
