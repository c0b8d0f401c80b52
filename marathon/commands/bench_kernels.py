"""`marathon bench kernels`: the Triton kernels against the public best on the GPU, in one run.

Times, on the same GPU and shapes: our chunked gated-delta kernel (kernels/gated_delta_triton.py),
flash-linear-attention's ``chunk_kda`` with the same bounded gate (``use_gate_in_kernel=True,
safe_gate=True, lower_bound=-5``) when ``fla`` is importable, and PyTorch SDPA (flash) causal attention,
forward + backward; the fused decode step; the MoE grouped GEMM against a per-expert loop and
``torch._grouped_mm``. Checks our outputs and gradients against the PyTorch reference for every timed
shape, in bf16 and fp32. Writes results.md, results.csv and kernels.png to ``--out``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import time
from pathlib import Path

FP32_TOL = 1e-4  # norm-relative error bounds (as in tests/test_kernels_gpu.py)
BF16_TOL = 2**-6
CHUNK = 64
WARM_TOKENS = 8192  # longest unpacked row of a --warm run


def register(subparsers) -> None:
    parser = subparsers.add_parser("kernels", help="Triton kernels vs flash-linear-attention and SDPA (needs CUDA)")
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="4096,16384,65536,262144,1048576", help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--sdpa-max", type=int, default=65536, help="longest length timed with SDPA")
    parser.add_argument("--torch-max", type=int, default=65536,
                        help="longest length timed with the chunked PyTorch path (kernels/chunked_gated_delta.py)")
    parser.add_argument("--check-heads", type=int, default=2,
                        help="heads checked against the fp64 reference (heads are independent)")
    parser.add_argument("--experts", default="64,128,256", help="MoE expert counts for the grouped GEMM")
    parser.add_argument("--moe-rows", type=int, default=65536, help="routed rows (tokens x top-k)")
    parser.add_argument("--moe-dims", default="2048,1024", help="D,F of one expert matmul")
    parser.add_argument("--check-budget-s", type=float, default=240.0,
                        help="seconds for the correctness checks (run after the timings); later lengths are skipped")
    parser.add_argument("--checks-only", action="store_true",
                        help="only the correctness checks (bf16, fp32) at --lengths, written to checks.json")
    parser.add_argument("--shapes", action="store_true",
                        help="only the shape table: ours through the model's dispatch vs fla, per model shape")
    parser.add_argument("--shape-index", type=int, action="append",
                        help="with --shapes: only these rows of SHAPES (repeatable)")
    parser.add_argument("--warm", action="store_true",
                        help="with --shapes: run each method's forward and backward once and time nothing: fills "
                             "Triton's compile cache (one process per shape in parallel uses the machine's cores; "
                             "the timed run after it then only autotunes). Unpacked rows run at most "
                             f"{WARM_TOKENS} tokens here: the compiled kernels do not depend on the length beyond "
                             "its divisibility by 16")
    parser.add_argument("--warm-shard", metavar="J/N", default="0/1",
                        help="with --warm: compile only every N-th autotuning config of each kernel, from the J-th "
                             "(0-based): N processes J = 0..N-1 compile one row's configs on N cores")
    parser.add_argument("--method", choices=("ours", "fla"), action="append",
                        help="with --shapes: only this method (repeatable; default both). With --warm, one process "
                             "per shape and method compiles on twice the cores")
    parser.add_argument("--out", default="benchmarks/kernels", help="output folder")
    parser.add_argument("--render-only", metavar="RESULTS_JSON",
                        help="re-render results.md/csv/png from a saved results.json (no GPU needed)")
    parser.add_argument("--checks-json", metavar="CHECKS_JSON",
                        help="with --render-only: take the checks from a --checks-only run's checks.json and "
                             "write the merged results.json to --out")


def _shard_autotuning(shard: str) -> None:
    """Every Triton autotuner of this process (ours and fla's) tries only configs J, J+N, ... of those it would
    try (``shard`` "J/N"; config J mod their count where they are fewer than N): N warm processes of one row
    compile its configs side by side. Their timings, taken on a busy GPU, select nothing later: the timed run
    autotunes over all the configs, whose disk-cache key differs from a shard's."""
    from triton.runtime.autotuner import Autotuner

    j, n = (int(x) for x in shard.split("/"))
    if not 0 <= j < n:
        raise SystemExit(f"--warm-shard {shard}: J must be in 0..N-1")
    if n == 1:
        return
    prune = Autotuner.prune_configs

    def sharded(self, kwargs, *args, **kw):
        configs = prune(self, kwargs, *args, **kw)
        return configs[j::n] or configs[j % len(configs):][:1]

    Autotuner.prune_configs = sharded


def _bench(fn, rep_ms: float = 200.0) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _peak_mem_gib(fn) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def kda_flops(B: int, T: int, H: int, K: int, V: int) -> float:
    """Matmul FLOPs of the chunked algorithm, forward + backward (backward counted as 2x forward).
    Per 64-token chunk: pair matrices 4C^2K, WY 2C^2K + 2C^2V, state 4CKV, output 2CKV + 2C^2V."""
    C = CHUNK
    per_chunk = 6 * C * C * K + 4 * C * C * V + 6 * C * K * V
    return 3.0 * per_chunk * B * H * (T / C)


def sdpa_flops(B: int, T: int, H: int, D: int) -> float:
    """Causal attention: forward 2 * 2 T^2 D / 2 per head, backward 2.5x forward (FlashAttention's count)."""
    return 3.5 * 2 * T * T * D * B * H


def _inputs(B, T, H, D, dtype, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    raw = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)  # gate logits
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).to(dtype)
    return q, k, v, raw, beta


def kda_check_case(B: int, T: int, heads: int, D: int) -> tuple:
    """Inputs (q, k, v, gate logits, beta; fp32), initial state and the random cotangents of o and the final
    state for a correctness check."""
    import torch

    x = _inputs(B, T, heads, D, torch.float32, seed=1)
    h0 = torch.randn(B, heads, D, D, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    do = torch.randn(B, T, heads, D, device="cuda", generator=gen, dtype=torch.float64)
    dht = torch.randn(B, heads, D, D, device="cuda", generator=gen, dtype=torch.float64)
    return x, h0, do, dht


def kda_outputs_and_grads(fn, case: tuple, inputs, dtype, fused: bool) -> list:
    """o, final state and the gradients of q, k, v, gate logits, beta and initial state of ``fn`` (a
    chunk_gated_delta_rule-like function) on ``inputs`` cast to ``dtype``. ``fused``: fn takes the raw gate
    logits and applies -5 sigmoid itself; otherwise the log-decay -5 sigmoid(raw) is passed."""
    import torch

    _, h0, do, dht = case
    q, k, v, raw, beta = [t.to(dtype).requires_grad_() for t in inputs]
    s0 = (h0.double() if dtype == torch.float64 else h0).clone().requires_grad_()
    o, ht = fn(q, k, v, raw if fused else -5 * torch.sigmoid(raw), beta, initial_state=s0, output_final_state=True)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    return [o.detach(), ht.detach(), *torch.autograd.grad(loss, (q, k, v, raw, beta, s0))]


def _check_kda(B: int, T: int, heads: int, D: int) -> dict:
    """Ours (bf16 and fp32) vs the chunked PyTorch reference in fp64 on the first `heads` heads:
    o, final state and the gradients of q, k, v, gate logits, beta, initial state."""
    import functools

    import torch

    from kernels.chunked_gated_delta import chunk_gated_delta_rule
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    out = {}
    case = kda_check_case(B, T, heads, D)
    x = case[0]
    ours_fn = functools.partial(chunk_gated_delta_rule_triton, gate_lower_bound=-5.0)
    for name, dtype, tol in (("bf16", torch.bfloat16, BF16_TOL), ("fp32", torch.float32, FP32_TOL)):
        ours = kda_outputs_and_grads(ours_fn, case, x, dtype, True)
        ref = kda_outputs_and_grads(chunk_gated_delta_rule, case, [t.to(dtype).double() for t in x], torch.float64,
                                    False)
        errs = [_rel(a, b) for a, b in zip(ours, ref)]
        finite = all(bool(torch.isfinite(a).all()) for a in ours)
        out[name] = {"max_rel_err": max(errs), "ok": finite and max(errs) < tol, "tol": tol,
                     "errs": dict(zip(["o", "ht", "dq", "dk", "dv", "dgate", "dbeta", "dh0"], errs))}
        print(f"T={T} {name} {json.dumps(out[name])}", flush=True)
        del ours, ref
        torch.cuda.empty_cache()
    return out


def _bench_kda(B, T, H, D, sdpa_max: int, torch_max: int, have_fla: bool) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.chunked_gated_delta import chunk_gated_delta_rule
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    q, k, v, raw, beta = [t.requires_grad_() for t in _inputs(B, T, H, D, torch.bfloat16)]
    do = torch.randn_like(v)
    leaves = (q, k, v, raw, beta)
    rows = []

    def fwd_bwd(fwd):
        def step():
            o = fwd()
            torch.autograd.grad(o, leaves, do)
        return step

    methods = {"ours": lambda: chunk_gated_delta_rule_triton(q, k, v, raw, beta, gate_lower_bound=-5.0)[0]}
    if have_fla:
        from fla.ops.kda import chunk_kda

        methods["fla_chunk_kda"] = lambda: chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, safe_gate=True,
                                                     lower_bound=-5.0)[0]
    if T <= torch_max:  # the model's portable path: PyTorch ops over 64-token chunks, 16-token matmul tiles
        methods["torch_chunked"] = lambda: chunk_gated_delta_rule(q, k, v, -5 * torch.sigmoid(raw.float()), beta)[0]
    for name, fwd in methods.items():
        try:
            with torch.no_grad():
                ms_f = _bench(fwd)
            ms = _bench(fwd_bwd(fwd))
            peak = _peak_mem_gib(fwd_bwd(fwd))
        except torch.cuda.OutOfMemoryError:  # reported as a missing point, not a crash of the whole run
            ms_f = ms = peak = float("nan")
            torch.cuda.empty_cache()
        rows.append({"method": name, "T": T, "fwd_ms": ms_f, "fwd_bwd_ms": ms, "peak_gib": peak,
                     "flops": kda_flops(B, T, H, D, D)})
    if T <= sdpa_max:
        qs, ks, vs = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        dos = do.transpose(1, 2).contiguous()

        def sdpa():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        def sdpa_step():
            torch.autograd.grad(sdpa(), (qs, ks, vs), dos)

        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION), torch.no_grad():
            ms_f = _bench(sdpa)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms = _bench(sdpa_step)
            peak = _peak_mem_gib(sdpa_step)
        rows.append({"method": "sdpa_flash", "T": T, "fwd_ms": ms_f, "fwd_bwd_ms": ms, "peak_gib": peak,
                     "flops": sdpa_flops(B, T, H, D)})
    for r in rows:
        r["Mtok_s"] = B * T / r["fwd_bwd_ms"] / 1e3
        r["tflops"] = r["flops"] / r["fwd_bwd_ms"] / 1e9
    return rows


# The shapes the model runs (head dims 64/128/256, 1-32 heads, packed rows), (B, T, H, D, dtype, packed lengths).
# "fp32": fp32 inputs at torch's default float32 matmul precision ("highest": our dots run as 3xTF32, fp32-accurate);
# "tf32": fp32 inputs at precision "high" (ours one TF32 product per dot, as fla's fp32 dots always are).
SHAPES = [(4, 8192, 32, 64, "bf16", None), (1, 32768, 8, 256, "bf16", None), (1, 32768, 8, 256, "fp32", None),
          (1, 65536, 16, 128, "bf16", None), (1, 16384, 1, 128, "bf16", None), (2, 16384, 32, 128, "bf16", None),
          (1, 65536, 16, 128, "bf16", "packed"), (1, 8192, 32, 64, "fp32", None), (1, 32768, 8, 256, "tf32", None)]


def _packed_lengths(T: int, seed: int = 0) -> list[int]:
    """Ragged episode lengths (1 to 8K, none a multiple of 64 but by chance) summing to T."""
    import random

    rng, out = random.Random(seed), []
    while sum(out) < T:
        out.append(min(rng.randint(1, 8192), T - sum(out)))
    return out


def _bench_shapes(have_fla: bool, save, indices: list[int] | None = None, warm: bool = False,
                  only: list[str] | None = None) -> list[dict]:
    """Forward and forward+backward ms of ours through ``kernels.gated_delta_rule`` (gate logits, fused, as the
    model calls it) and of fla's ``chunk_kda`` with the same bounded gate, on each shape of SHAPES (or those at
    ``indices``); ``save(rows)`` after each shape, so a run cut short keeps what it measured. ``warm``: one call
    of each instead of timings (compiles and autotunes; the rows' times are None); ``only``: these methods."""
    import torch

    import kernels
    from kernels.gated_delta_triton import float32_matmul_precision

    rows = []
    timed = (lambda fn: (fn(), torch.cuda.synchronize(), None)[-1]) if warm else _bench
    for B, T, H, D, dt, packed in (SHAPES[i] for i in indices) if indices else SHAPES:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        n = min(T, WARM_TOKENS) if warm and not packed else T
        q, k, v, raw, beta = [t.requires_grad_() for t in _inputs(B, n, H, D, dtype)]
        cu = None
        if packed:
            cu = torch.tensor([0, *torch.tensor(_packed_lengths(T)).cumsum(0).tolist()], device="cuda")
        do = torch.randn_like(v)
        methods = {"ours": lambda: kernels.gated_delta_rule(q, k, v, raw, beta, gate_lower_bound=-5.0,
                                                            cu_seqlens=cu)[0]}
        if have_fla:
            from fla.ops.kda import chunk_kda

            methods["fla"] = lambda: chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, safe_gate=True,
                                               lower_bound=-5.0, cu_seqlens=cu)[0]
        row = {"B": B, "T": T, "H": H, "D": D, "dtype": dt, "packed": 0 if cu is None else len(cu) - 1}
        for name, fwd in methods.items():
            if only and name not in only:
                continue
            try:
                with float32_matmul_precision("high" if dt == "tf32" else "highest"):
                    with torch.no_grad():
                        row[f"{name}_fwd_ms"] = timed(fwd)
                    row[f"{name}_fwd_bwd_ms"] = timed(lambda: torch.autograd.grad(fwd(), (q, k, v, raw, beta), do))
            except Exception as e:  # noqa: BLE001 - a failing method is a table entry, not a crashed run
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
        if "fla_fwd_bwd_ms" in row and "ours_fwd_bwd_ms" in row and not warm:
            row["ours_over_fla_fwd_bwd"] = row["fla_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"]  # throughput ratio
            row["ours_over_fla_fwd"] = row["fla_fwd_ms"] / row["ours_fwd_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
    return rows


def _shapes_markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Gated delta rule per model shape ({meta['device']}, fla {meta['fla']})", "",
             f"Command: `{meta['command']}`. Ours through `kernels.gated_delta_rule` with the gate fused, as the "
             "model calls it; fla's `chunk_kda(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5)`. "
             "Ratios are throughput, ours / fla (> 1: ours faster). dtype fp32: fp32 inputs, our dots 3xTF32 "
             "(fp32-accurate, torch's default float32 matmul precision 'highest'); tf32: fp32 inputs at precision "
             "'high', our dots one TF32 product each. fla's fp32 dots are TF32 in both.", "",
             "| B | T | H | K=V | dtype | packed seqs | ours fwd ms | fla fwd ms | fwd ratio | ours fwd+bwd ms | "
             "fla fwd+bwd ms | fwd+bwd ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['T']} | {r['H']} | {r['D']} | {r['dtype']} | {r['packed'] or ''} | "
                     + " | ".join(_shape_cell(r, k) for k in ("ours_fwd_ms", "fla_fwd_ms", "ours_over_fla_fwd",
                                                              "ours_fwd_bwd_ms", "fla_fwd_bwd_ms",
                                                              "ours_over_fla_fwd_bwd")) + " |")
    return "\n".join(lines) + "\n"


def _shape_cell(row: dict, key: str) -> str:
    """A time or ratio of a shape-table row; a failed method's error in its fwd+bwd cell (where its time stops)."""
    if row.get(key) is not None:
        return f"{row[key]:.2f}"
    method = key.split("_")[0]
    failed = f"{method}_error" in row and key == f"{method}_fwd_bwd_ms"
    return row[f"{method}_error"][:40] if failed else ""


def _bench_decode(B, H, D, copy_gbs: float) -> dict:
    import torch

    from kernels.gated_delta import gated_delta_rule_step
    from kernels.gated_delta_triton import gated_delta_rule_step_triton

    q, k, v, raw, beta = [t[:, 0].float() for t in _inputs(B, 1, H, D, torch.float32, seed=3)]
    g = -5 * torch.sigmoid(raw)
    state = torch.randn(B, H, D, D, device="cuda")
    o_ref, s_ref = gated_delta_rule_step(q, k, v, g, beta, state.clone())
    o, s = gated_delta_rule_step_triton(q, k, v, g, beta, state.clone())
    err = max(_rel(o, o_ref), _rel(s, s_ref))
    ms = _bench(lambda: gated_delta_rule_step_triton(q, k, v, g, beta, state, inplace=True), 200)
    ms_ref = _bench(lambda: gated_delta_rule_step(q, k, v, g, beta, state), 200)
    gbs = 2 * state.numel() * 4 / ms / 1e6  # state read + written
    return {"B": B, "H": H, "D": D, "ours_us": ms * 1e3, "torch_us": ms_ref * 1e3, "speedup": ms_ref / ms,
            "state_GB_s": gbs, "frac_copy_bw": gbs / copy_gbs, "max_rel_err": err, "ok": err < FP32_TOL}


def _bench_moe(E: int, N: int, D: int, Fd: int, peak_tflops: float) -> dict:
    import torch

    from kernels.grouped_gemm import grouped_mm_reference
    from kernels.grouped_gemm_triton import grouped_mm_triton

    gen = torch.Generator(device="cuda").manual_seed(E)
    # top-k routing with skew: expert loads drawn from a Dirichlet-like spread, sorted rows
    p = torch.rand(E, device="cuda", generator=gen) + 0.2
    expert = torch.multinomial(p / p.sum(), N, replacement=True, generator=gen)
    counts = torch.bincount(expert, minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(E, D, Fd, device="cuda", generator=gen) / D**0.5).to(torch.bfloat16)
    y = grouped_mm_triton(x, w, offsets)
    err = _rel(y, grouped_mm_reference(x.double(), w.double(), offsets))
    flops = 2.0 * N * D * Fd
    res = {"E": E, "N": N, "D": D, "F": Fd, "max_rel_err": err, "ok": err < BF16_TOL,
           "ours_ms": _bench(lambda: grouped_mm_triton(x, w, offsets)),
           "loop_ms": _bench(lambda: grouped_mm_reference(x, w, offsets))}
    if hasattr(torch, "_grouped_mm"):
        offs32 = offsets[1:].to(torch.int32)
        wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # column-major per expert, as cuBLAS wants
        try:
            res["torch_grouped_ms"] = _bench(lambda: torch._grouped_mm(x, wt, offs=offs32))
        except RuntimeError as e:  # not supported for this dtype/layout on this build
            res["torch_grouped_ms"] = float("nan")
            res["torch_grouped_error"] = str(e).splitlines()[0]
    # forward + backward (dx through the same kernel, dw through the weight-gradient kernel)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(y)
    res["ours_fwd_bwd_ms"] = _bench(lambda: torch.autograd.grad(grouped_mm_triton(xg, wg, offsets), (xg, wg), dy))
    res["loop_fwd_bwd_ms"] = _bench(lambda: torch.autograd.grad(grouped_mm_reference(xg, wg, offsets), (xg, wg), dy))
    res["speedup_vs_loop"] = res["loop_ms"] / res["ours_ms"]
    res["speedup_fwd_bwd_vs_loop"] = res["loop_fwd_bwd_ms"] / res["ours_fwd_bwd_ms"]
    res["ours_tflops"] = flops / res["ours_ms"] / 1e9
    res["frac_peak"] = res["ours_tflops"] / peak_tflops
    return res


def _ceilings() -> dict:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _bench(lambda: a @ b)
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    cp_ms = _bench(lambda: dst.copy_(src))
    return {"bf16_matmul_tflops": 2 * 8192**3 / mm_ms / 1e9, "copy_GB_s": 2 * src.numel() * 4 / cp_ms / 1e6}


def _plot(kda_rows: list[dict], moe_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in dict.fromkeys(r["method"] for r in kda_rows):
        rs = [r for r in kda_rows if r["method"] == method]
        ax1.plot([r["T"] for r in rs], [r["Mtok_s"] for r in rs], marker="o", label=method)
    ax1.set(xscale="log", yscale="log", xlabel="tokens", ylabel="Mtokens/s (fwd+bwd)",
            title="Gated delta rule (KDA, bounded gate) vs SDPA, H200 bf16")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    xs = range(len(moe_rows))
    width = 0.27
    ax2.bar([i - width for i in xs], [r["ours_ms"] for r in moe_rows], width, label="ours (Triton grouped)")
    ax2.bar(list(xs), [r["loop_ms"] for r in moe_rows], width, label="per-expert loop")
    ax2.bar([i + width for i in xs], [r.get("torch_grouped_ms", float("nan")) for r in moe_rows], width,
            label="torch._grouped_mm")
    ax2.set_xticks(list(xs), [f"E={r['E']}" for r in moe_rows])
    ax2.set(ylabel="ms (forward)", yscale="log", title="MoE grouped GEMM, bf16")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _markdown(meta, checks, kda_rows, decode, moe_rows, crossover) -> str:
    peak = meta["ceilings"]["bf16_matmul_tflops"]
    command = f"Command: `{meta['command']}`"
    if "check_command" in meta:
        command += f"; checks: `{meta['check_command']}`"
    lines = [f"# Kernel benchmarks ({meta['device']})", "", command, "",
             f"torch {meta['torch']}, triton {meta['triton']}, fla {meta['fla']}; B={meta['B']}, H={meta['H']}, "
             f"K=V={meta['D']}, bf16 inputs, fp32 state; gate -5*sigmoid(raw) fused in-kernel for both "
             "linear-attention kernels. Times are medians of triton.testing.do_bench.", "",
             f"Measured ceilings: bf16 matmul 8192^3 {peak:.0f} TFLOP/s, device copy "
             f"{meta['ceilings']['copy_GB_s']:.0f} GB/s.", "",
             "## Linear attention, forward + backward", "",
             "| tokens | method | fwd ms | fwd+bwd ms | Mtok/s | TFLOP/s | % bf16 peak | peak mem GiB | ours/fla throughput |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["method"], r["T"]): r for r in kda_rows}
    for r in kda_rows:
        if r["fwd_bwd_ms"] != r["fwd_bwd_ms"]:  # NaN: out of GPU memory in that run
            lines.append(f"| {r['T']} | {r['method']} | OOM | OOM | | | | | |")
            continue
        ratio = ""
        fla = by.get(("fla_chunk_kda", r["T"]))
        if r["method"] == "ours" and fla and fla["fwd_bwd_ms"] == fla["fwd_bwd_ms"]:
            ratio = f"{by[('fla_chunk_kda', r['T'])]['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
        lines.append(f"| {r['T']} | {r['method']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['Mtok_s']:.2f} | "
                     f"{r['tflops']:.1f} | {100 * r['tflops'] / peak:.1f} | {r['peak_gib']:.2f} | {ratio} |")
    vs_torch = [f"{T}: {by[('torch_chunked', T)]['fwd_bwd_ms'] / r['fwd_bwd_ms']:.1f}x" for (m, T), r in by.items()
                if m == "ours" and ("torch_chunked", T) in by]
    lines += ["", f"Crossover (ours faster than SDPA flash, fwd+bwd): {crossover}", "",
              "Ours vs the chunked PyTorch path (`kernels/chunked_gated_delta.py`, same algorithm in PyTorch ops), "
              f"fwd+bwd speedup: {', '.join(vs_torch) or 'not timed'}", "",
              "TFLOP/s count the chunked algorithm's matmuls (`kda_flops`) and causal attention's "
              "(`sdpa_flops`); only SDPA and the grouped GEMM are matmul-bound.", "",
              "## Correctness vs the PyTorch reference (fp64, chunked path, first "
              f"{meta['check_heads']} heads; o, final state, all gradients)", "",
              "| tokens | dtype | max norm-rel error | tol | ok | worst tensor |", "|---|---|---|---|---|---|"]
    for T, c in checks.items():
        for dt, r in c.items():
            worst = max(r["errs"], key=r["errs"].get)
            lines.append(f"| {T} | {dt} | {r['max_rel_err']:.2e} | {r['tol']:.1e} | {r['ok']} | {worst} |")
    unchecked = sorted({r["T"] for r in kda_rows} - set(checks))
    if unchecked:
        lines.append(f"| {', '.join(map(str, unchecked))} | - | not checked (--check-budget-s) | | | |")
    lines += ["", "## Decode step (fused, fp32 state, in place)", "",
              "| B | H | D | ours us | torch us | speedup | state GB/s | % copy bw | rel err |",
              "|---|---|---|---|---|---|---|---|---|",
              f"| {decode['B']} | {decode['H']} | {decode['D']} | {decode['ours_us']:.1f} | {decode['torch_us']:.1f} | "
              f"{decode['speedup']:.1f}x | {decode['state_GB_s']:.0f} | {100 * decode['frac_copy_bw']:.0f} | "
              f"{decode['max_rel_err']:.1e} |", "",
              "## MoE grouped GEMM (bf16, x [N, D] sorted by expert, w [E, D, F])", "",
              "| E | N | D | F | ours ms | loop ms | torch._grouped_mm ms | speedup vs loop | fwd+bwd ours ms | "
              "fwd+bwd loop ms | fwd+bwd speedup | TFLOP/s | % bf16 peak | rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in moe_rows:
        lines.append(f"| {r['E']} | {r['N']} | {r['D']} | {r['F']} | {r['ours_ms']:.3f} | {r['loop_ms']:.3f} | "
                     f"{r.get('torch_grouped_ms', float('nan')):.3f} | {r['speedup_vs_loop']:.1f}x | "
                     f"{r['ours_fwd_bwd_ms']:.3f} | {r['loop_fwd_bwd_ms']:.3f} | {r['speedup_fwd_bwd_vs_loop']:.1f}x | "
                     f"{r['ours_tflops']:.0f} | {100 * r['frac_peak']:.0f} | {r['max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def _write_outputs(out: Path, meta, checks, kda_rows, decode, moe_rows) -> None:
    """results.md, results.csv and kernels.png from the measured rows (also used by --render-only)."""
    ours = {r["T"]: r["fwd_bwd_ms"] for r in kda_rows if r["method"] == "ours"}
    sdpa = {r["T"]: r["fwd_bwd_ms"] for r in kda_rows if r["method"] == "sdpa_flash"}
    faster = [T for T in sorted(sdpa) if ours[T] < sdpa[T]]
    timed = ", ".join(f"{T}: {ours[T]:.2f} vs {sdpa[T]:.2f} ms" for T in sorted(sdpa))
    crossover = (f"ours is faster from {faster[0]} tokens on (ours vs SDPA fwd+bwd at {timed})" if faster
                 else f"not reached at the lengths timed ({timed})")
    (out / "results.md").write_text(_markdown(meta, checks, kda_rows, decode, moe_rows, crossover))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(kda_rows[0]))
        writer.writeheader()
        writer.writerows(kda_rows)
    _plot(kda_rows, moe_rows, out / "kernels.png")
    print((out / "results.md").read_text())


def _run_checks(args: argparse.Namespace, lengths: list[int], checks: dict, save) -> None:
    """Correctness checks at each length into ``checks`` (saved after each) until --check-budget-s is spent."""
    t_checks = time.time()
    for T in lengths:
        if time.time() - t_checks > args.check_budget_s:
            print(f"T={T} check not run: --check-budget-s {args.check_budget_s} spent", flush=True)
            continue
        t0 = time.time()
        checks[T] = _check_kda(args.batch, T, min(args.check_heads, args.heads), args.head_dim)
        print(f"T={T} check {json.dumps(checks[T])} ({time.time() - t0:.0f}s)", flush=True)
        save()


def main(args: argparse.Namespace) -> int:
    if args.render_only:
        data = json.loads(Path(args.render_only).read_text())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.checks_json:
            checked = json.loads(Path(args.checks_json).read_text())
            data["checks"], data["meta"]["check_command"] = checked["checks"], checked["meta"]["command"]
            (out / "results.json").write_text(json.dumps(data, indent=1))
        checks = {int(k): v for k, v in data["checks"].items()}
        _write_outputs(out, data["meta"], checks, data["kda"], data["decode"], data["moe"])
        return 0
    import torch

    if not torch.cuda.is_available():
        print("marathon bench kernels needs a CUDA GPU (the Triton kernels run only there); "
              "run it on the GPU machine.", file=sys.stderr)
        return 1
    import triton

    try:
        import fla

        fla_version = fla.__version__
    except ImportError:
        fla_version = "not installed (comparison skipped)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    B, H, D = args.batch, args.heads, args.head_dim
    lengths = [int(x) for x in args.lengths.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fla": fla_version, "B": B, "H": H, "D": D, "check_heads": args.check_heads,
            "command": "marathon bench kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:]
                                                            if a not in ("bench", "kernels"))}
    if args.shapes:
        if args.warm:
            _shard_autotuning(args.warm_shard)

        def save(rows):
            (out / "shapes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out / "shapes.md").write_text(_shapes_markdown(meta, rows))

        rows = _bench_shapes(not fla_version.startswith("not"), (lambda rows: None) if args.warm else save,
                             args.shape_index, args.warm, args.method)
        return 0 if all(f"{m}_fwd_bwd_ms" in r for r in rows for m in args.method or ["ours"]) else 1
    if args.checks_only:
        checks = {}
        _run_checks(args, lengths, checks, lambda: (out / "checks.json").write_text(
            json.dumps({"meta": meta, "checks": checks}, indent=1)))
        return 0 if checks and all(r["ok"] for c in checks.values() for r in c.values()) else 1
    meta["ceilings"] = _ceilings()
    print(json.dumps(meta), flush=True)
    kda_rows, checks, moe_rows, decode = [], {}, [], None

    def save():
        (out / "results.json").write_text(json.dumps({"meta": meta, "checks": {str(k): v for k, v in checks.items()},
                                                      "kda": kda_rows, "decode": decode, "moe": moe_rows}, indent=1))

    for T in lengths:  # timings first: they are the scarce part of a device lease
        t0 = time.time()
        rows = _bench_kda(B, T, H, D, args.sdpa_max, args.torch_max, not fla_version.startswith("not"))
        for r in rows:
            print(json.dumps(r), flush=True)
        kda_rows += rows
        print(f"T={T} timed ({time.time() - t0:.0f}s)", flush=True)
        torch.cuda.empty_cache()
        save()
    decode = _bench_decode(64, H, D, meta["ceilings"]["copy_GB_s"])
    print(json.dumps(decode), flush=True)
    Dm, Fm = (int(x) for x in args.moe_dims.split(","))
    for E in (int(x) for x in args.experts.split(",")):
        moe_rows.append(_bench_moe(E, args.moe_rows, Dm, Fm, meta["ceilings"]["bf16_matmul_tflops"]))
        print(json.dumps(moe_rows[-1]), flush=True)
    save()
    _run_checks(args, lengths, checks, save)
    _write_outputs(out, meta, checks, kda_rows, decode, moe_rows)
    ok = all(r["ok"] for c in checks.values() for r in c.values()) and decode["ok"] and all(r["ok"] for r in moe_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="marathon bench kernels")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
