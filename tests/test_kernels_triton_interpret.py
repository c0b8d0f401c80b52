"""The Triton linear-attention kernels (kernels/gated_delta_triton.py) run on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``) in fp32 and must match the fp64 recurrent reference: every kernel's
indexing, masking of ragged chunks and the whole backward pass are checked here without a GPU. (The
interpreter's bf16 dots are not faithful; bf16 accuracy and speed are measured on the GPU by
tests/test_kernels_gpu.py and ``marathon bench kernels``.) Each case runs in a subprocess because the
interpreter is chosen when the kernels are defined."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = sorted((ROOT / "benchmarks" / "kernels" / "candidates").glob("*.patch"))

CHECK = r"""
import json, os, sys
import torch, torch.nn.functional as F, triton
if os.environ.get("EMULATE_TF32"):  # the GPU's fp32 dots: "tf32" one product of operands cut to 10 mantissa bits,
    # "tf32x3" three (head x head + head x tail + tail x head); torch's float32 matmul precision "high" picks tf32
    import numpy as np
    import triton.runtime.interpreter as interp

    def tf32(x):
        return (np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y, p = a.data, b.data, str(input_precision).upper()
        if x.dtype == y.dtype == np.float32 and "IEEE" not in p:
            xh, yh = tf32(x), tf32(y)
            r = xh @ yh + (xh @ tf32(y - yh) + tf32(x - xh) @ yh if "TF32X3" in p else 0)
            return interp.TensorHandle(r.astype(d.data.dtype) + d.data, d.dtype.scalar)
        return interp.TensorHandle(np.matmul(x, y, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot
    torch.set_float32_matmul_precision("high")
import kernels.gated_delta_triton as gdt
from kernels.gated_delta import recurrent_gated_delta_rule

B, T, H, K, V, BV, BK, fused, lengths = json.loads(sys.argv[1])
cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
if cu is not None:
    B, T = 1, int(cu[-1])
# the interpreter cannot time configs: give each autotuned kernel the one config under test
for kern in (gdt._state_fwd_kernel, gdt._state_bwd_kernel):
    kern.configs = [triton.Config({"BV": BV}, num_warps=4, num_stages=2)]
gdt._bwd_pair_kernel.configs = [triton.Config({"BK": BK}, num_warps=4)]
gdt._bwd_state_side_kernel.configs = [triton.Config({"BK": BK, "BV": min(BV, 32)}, num_warps=4)]
torch.manual_seed(T + K)
q = F.normalize(torch.randn(B, T, H, K), dim=-1)
k = F.normalize(torch.randn(B, T, H, K), dim=-1)
v = torch.randn(B, T, H, V)
raw = 3 * torch.randn(B, T, H, K)  # strong gates: in-tile decays near the -5 bound
beta = torch.sigmoid(torch.randn(B, T, H))
h0 = torch.randn(B if cu is None else len(lengths), H, K, V)
# every buffer allocated from here on starts as NaN: a kernel that reads what no kernel wrote (Akk's and Aqk's
# blocks above the diagonal are left unwritten) fails the check
_empty, _empty_like = torch.empty, torch.empty_like
nan_filled = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t  # noqa: E731
torch.empty = lambda *a, **kw: nan_filled(_empty(*a, **kw))
torch.empty_like = lambda *a, **kw: nan_filled(_empty_like(*a, **kw))

def per_sequence(q, k, v, g, beta, initial_state, output_final_state):  # the reference, sequence by sequence
    outs = [recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                       initial_state=initial_state[i:i + 1], output_final_state=True)
            for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))]
    return torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs], 0)

def run(fn, dtype, gate):
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v, raw, beta)]
    s0 = h0.to(dtype).clone().requires_grad_()
    kw = {} if cu is None or fn is per_sequence else {"cu_seqlens": cu}
    if gate == "fused":
        o, ht = fn(*xs, initial_state=s0, output_final_state=True, gate_lower_bound=-5.0, **kw)
    else:
        o, ht = fn(*xs[:3], -5 * torch.sigmoid(xs[3]), xs[4], initial_state=s0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    return [o.detach(), ht.detach(), *torch.autograd.grad(loss, (*xs, s0))]

ref = run(recurrent_gated_delta_rule if cu is None else per_sequence, torch.float64, "graph")
out = run(gdt.chunk_gated_delta_rule_triton, torch.float32, "fused" if fused else "graph")
names = ["o", "final_state", "dq", "dk", "dv", "dgate", "dbeta", "dh0"]
print(json.dumps({n: ((a.double() - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")
                  for n, a, b in zip(names, out, ref)}))
"""


@pytest.mark.parametrize("B, T, H, K, V, BV, BK, fused, lengths", [
    (2, 150, 2, 64, 64, 32, 64, True, None),      # ragged last chunk, two rows
    (1, 200, 2, 128, 128, 16, 32, False, None),   # K = V = 128, narrowest slices, gate applied outside
    (1, 64, 1, 128, 128, 64, 16, True, None),     # exactly one chunk, narrowest K-slices
    (3, 1, 1, 64, 64, 64, 64, True, None),        # one token
    (1, 0, 2, 64, 64, 32, 64, True, [1, 63, 65, 2, 128, 30]),  # packed row: ragged sequences, own states
    (1, 0, 1, 64, 64, 64, 32, False, [64, 128, 64]),  # packed row of aligned sequences
    (1, 0, 1, 64, 64, 16, 64, True, [1, 2]),      # one-chunk sequences: the state passes' MIN_STEPS repeats
    (1, 0, 1, 64, 64, 64, 64, True, [1, 63, 65, 1000, 4097]),  # the ragged row (45 s)
    (1, 0, 1, 256, 256, 16, 64, True, [70, 60]),  # K = V = 256, packed
])
def test_triton_kernels_match_reference_in_interpreter(B, T, H, K, V, BV, BK, fused, lengths):
    errs = _interpret([B, T, H, K, V, BV, BK, fused, lengths])
    # fp32 arithmetic throughout (exact fp32 dots in the interpreter): measured ~1e-6..1e-5
    assert max(errs.values()) < 1e-4, errs


def _interpret(case: list, **env: str) -> dict:
    """The interpreted kernels' errors against the fp64 reference on one CHECK case."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(case)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not CANDIDATES, reason="no kernel change is waiting for a GPU")
def test_kernel_candidates_still_apply_and_match_the_reference(tmp_path):
    """The kernel changes waiting for a GPU lease (benchmarks/kernels/candidates/*.patch, applied in order, kernels
    and their tests) still apply to this tree, and the patched kernels, with the patched check, match the reference
    on two of the cases above: two ragged rows at K = V = 64, a packed row at K = V = 256."""
    for part in ("kernels", "tests", "benchmarks/kernels"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "logs", "*.png"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    applied = subprocess.run(["git", "apply", *map(str, CANDIDATES)], cwd=tmp_path, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_kernels_triton_interpret.py", "-k", "2-150-2-64 or 256-256"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_gate_gradient_in_tf32_is_as_accurate_as_the_other_gradients():
    """At float32 matmul precision "high" (TF32 dots, emulated in the interpreter) the gate gradient's error stays
    at the other gradients' level (~1e-3): the Aqk pair products, whose errors cancel in it, run in 3xTF32.
    Measured with them in TF32: dgate 3.1e-3 against dq 1.7e-3 and the rest near 1.1e-3."""
    errs = _interpret([1, 256, 2, 64, 64, 32, 64, True, None], EMULATE_TF32="1")
    grads = {n: e for n, e in errs.items() if n.startswith("d") and n != "dgate"}
    assert 3e-4 < max(grads.values()) < 2**-9, errs  # TF32's rounding is there, and only that much
    assert errs["dgate"] < 1.2 * max(grads.values()), errs


def test_state_kernels_run_unpipelined_only_where_pipelined_configs_do_not_fit():
    """fp32 operands (3xTF32 or TF32 dots alike) with a head dim over 128 autotune over the single-stage state
    configs alone (a pipelined one needs more shared memory than the H200 has); every other shape over the pipelined
    ones alone."""
    import torch

    from kernels.gated_delta_triton.chunk_fwd import STATE_CONFIGS, _state_configs

    def stages(dtype, K, V):
        args = {"kd": torch.empty(0, dtype=dtype), "K": K, "V": V}
        return {c.num_stages for c in _state_configs(STATE_CONFIGS, args)}

    assert stages(torch.float32, 256, 256) == stages(torch.float32, 64, 256) == {1}
    assert stages(torch.float32, 128, 128) == stages(torch.bfloat16, 256, 256) == stages(torch.float16, 64, 64) == {2, 3}


def test_fp32_dots_follow_torchs_float32_matmul_precision():
    """fp32 inputs: 3xTF32 dots at the default precision "highest", one TF32 product at "high" (what fla's fp32
    kernels use); 16-bit inputs: tf32 for the fp32 pair products whatever is set."""
    import torch

    from kernels.gated_delta_triton import float32_matmul_precision
    from kernels.gated_delta_triton.common import _prec

    f32, bf16 = torch.empty(0), torch.empty(0, dtype=torch.bfloat16)
    assert torch.get_float32_matmul_precision() == "highest"
    assert (_prec(f32), _prec(bf16)) == ("tf32x3", "tf32")
    with float32_matmul_precision("high"):
        assert (_prec(f32), _prec(bf16)) == ("tf32", "tf32")
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_row_of_more_chunks_than_a_grid_axis_holds_is_refused():
    """65,536 one-token sequences are 65,536 chunks, one more than the per-chunk kernels' grid axis holds: a clear
    error before any launch (the model's dispatch cuts long rows into segments)."""
    import torch

    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    T = 65536
    q = torch.zeros(1, T, 1, 64)
    with pytest.raises(ValueError, match="65536 chunks of 64 tokens in one row, over the 65535"):
        chunk_gated_delta_rule_triton(q, q, q, q, torch.zeros(1, T, 1), gate_lower_bound=-5.0,
                                      cu_seqlens=torch.arange(T + 1))
