"""Compile every Triton kernel of kernels/gated_delta_triton.py for the H200 (sm_90) without a GPU and print
registers, stack (spilled bytes) and shared memory per kernel and launch config: compile errors and spills
show up here before any device time is spent.

Needs a Triton with the NVIDIA backend (ptxas, cuobjdump), e.g. the device's version in a side folder:

    pip install --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. .venv/bin/python benchmarks/kernels/resources.py [bf16|fp32] [head dim, 128] [highest|high]

(the third argument: ``torch.set_float32_matmul_precision``, which picks fp32's dots: 3xTF32 or TF32).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.gated_delta_triton import chunk_bwd, chunk_fwd, fused_recurrent  # noqa: E402
from kernels.gated_delta_triton.common import _prec  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

gdt = types.SimpleNamespace(**{**vars(chunk_fwd), **vars(chunk_bwd), **vars(fused_recurrent)})  # every kernel

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
H = 16
K = V = int(sys.argv[2]) if len(sys.argv) > 2 else 128
if len(sys.argv) > 3:
    torch.set_float32_matmul_precision(sys.argv[3])
INTS = {"T": "i32", "NT": "i32"}


def report(name: str, kernel, types: dict, constants: dict, num_warps: int = 4, num_stages: int = 2) -> bool:
    """Compile one kernel specialization; print its resource use. ``types``: the non-constexpr arguments."""
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    signature = {n: "constexpr" if n in constants else types[n] for n in fn.arg_names}
    # pointers 16-byte aligned, as the launcher specializes torch's allocations: without it 16-bit loads look
    # unaligned (one element per copy), and the software pipeliner leaves them out (no shared-memory stages)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")}
    src = ASTSource(fn=fn, signature=signature, attrs=aligned,
                    constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()})
    try:
        compiled = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # noqa: BLE001 - report every kernel, then fail
        print(f"{name:34s} FAILED {type(e).__name__}: {str(e)[-1500:]}", flush=True)
        return False
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    regs, stack = m.groups() if m else ("?", "?")
    print(f"{name:34s} regs {regs:>4s}  stack {stack:>5s} B  shared {compiled.metadata.shared:>6d} B", flush=True)
    return True


def main(dtype: str) -> int:
    prec = _prec(torch.empty(0, K, dtype=DTYPES[dtype]))  # the dots the dispatch picks
    x, f32 = f"*{dtype}", "*fp32"

    def ptrs(names: str, t: str = x) -> dict:
        return {n: t for n in names.split()}

    rows = {"chunk_rows": "*i32"}

    def chunked(varlen: bool) -> dict:  # whole rows pass no chunk table: a None argument is a constexpr None
        return dict(VARLEN=varlen, **({} if varlen else dict(chunk_rows=None)))

    ok = []
    for varlen in (False, True):  # whole rows, packed rows (their chunk table)
        var = chunked(varlen)
        tag = " varlen" if varlen else ""
        ok += [
            report("gate_cumsum" + tag, gdt._gate_cumsum_kernel, {**ptrs("g"), **ptrs("G", f32), "lower_bound": "fp32",
                   **rows, **INTS}, dict(H=H, K=K, GATE=True, **var)),
            report("pair_matrices" + tag, gdt._pair_matrices_kernel, {**ptrs("q k beta Aqk"), **ptrs("G Akk", f32),
                   "scale": "fp32", **rows, **INTS}, dict(H=H, K=K, PREC=prec, **var)),
            report("solve_wy" + tag, gdt._solve_wy_kernel, {**ptrs("q k v beta w u kd qg Tinv"),
                   **ptrs("G Akk", f32), "scale": "fp32", **rows, **INTS},
                   dict(H=H, K=K, V=V, BK=64, BV=64, PREC=prec, **var)),
            report("output" + tag, gdt._output_kernel, {**ptrs("qg h Aqk U o"), **rows, **INTS},
                   dict(H=H, K=K, V=V, BV=64, PREC=prec, **var)),
            report("bwd_intra_dU" + tag, gdt._bwd_intra_dU_kernel, {**ptrs("Aqk do"), **ptrs("dU", f32), **rows,
                   **INTS}, dict(H=H, V=V, BV=64, PREC=prec, **var)),
            report("bwd_value" + tag, gdt._bwd_value_kernel, {**ptrs("v beta U do dv Tinv"),
                   **ptrs("dU dAqk dT dbeta", f32), **rows, **INTS}, dict(H=H, V=V, BV=64, PREC=prec, **var)),
            report("bwd_state_side" + tag, gdt._bwd_state_side_kernel, {**ptrs("q k beta h dh U do Tinv"),
                   **ptrs("G dU dq_p dk_p dG_p dT dbeta", f32), "scale": "fp32", **rows, **INTS},
                   dict(H=H, K=K, V=V, BK=64, BV=64, PREC=prec, **var)),
            report("bwd_dAkk" + tag, gdt._bwd_dAkk_kernel, {**ptrs("Tinv"), **ptrs("dT", f32), **rows, **INTS},
                   dict(H=H, PREC=prec, **var)),
            report("bwd_gate" + tag, gdt._bwd_gate_kernel, {**ptrs("g"), **ptrs("dG dg", f32), "lower_bound": "fp32",
                   **rows, **INTS}, dict(H=H, K=K, BK=64, GATE=True, **var)),
        ]
    ok.append(report("decode_step", gdt._decode_step_kernel, {**ptrs("q k v g beta state o new_state", f32),
                     "scale": "fp32"}, dict(H=H, K=K, V=V, BV=32)))
    seqs = ptrs("seqs", "*i32")
    # whole rows with initial / final states (the tests), packed rows with them, packed rows without (training)
    for c, varlen, st in ((c, v, st) for c in gdt.STATE_CONFIGS for v, st in ((False, True), (True, True),
                                                                             (True, False))):
        tag = f"BV{c.kwargs['BV']} w{c.num_warps} s{c.num_stages}" + (" varlen" if varlen else "") + \
            ("" if st else " no-states")
        # a kernel argument that is None (no initial state, a whole row's sequence table) is a constexpr None
        no_seqs = {} if varlen else dict(seqs=None)
        fwd_unused = no_seqs | ({} if st else dict(h0=None, ht=None))
        bwd_unused = no_seqs | ({} if st else dict(dht=None, dh0=None))
        ok.append(report(f"state_fwd {tag}", gdt._state_fwd_kernel, {**ptrs("kd w u h U"), **ptrs("G h0 ht", f32),
                         **seqs, **INTS}, dict(H=H, K=K, V=V, BV=c.kwargs["BV"], HAS_H0=st, STORE_HT=st,
                                                 VARLEN=varlen, PREC=prec, **fwd_unused),
                         c.num_warps, c.num_stages))
        ok.append(report(f"state_bwd {tag}", gdt._state_bwd_kernel, {**ptrs("qg kd w do dh"),
                         **ptrs("G dU dht dh0", f32), **seqs, **INTS}, dict(H=H, K=K, V=V, BV=c.kwargs["BV"],
                         HAS_DHT=st, STORE_DH0=st, VARLEN=varlen, PREC=prec, **bwd_unused),
                         c.num_warps, c.num_stages))
    for c in gdt.PAIR_CONFIGS:
        tag = f"BK{c.kwargs['BK']} w{c.num_warps} s{c.num_stages}"
        for varlen in (False, True):
            ok.append(report(f"bwd_pair {tag}" + (" varlen" if varlen else ""), gdt._bwd_pair_kernel,
                             {**ptrs("q k beta dq dk"), **ptrs("G dAkk dAqk dq_p dk_p dG dbeta", f32),
                              "scale": "fp32", **rows, **INTS},
                             dict(H=H, K=K, BK=c.kwargs["BK"], PREC=prec, **chunked(varlen)), c.num_warps,
                             c.num_stages))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bf16"))
