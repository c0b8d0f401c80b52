"""Triton kernels (kernels/gated_delta_triton.py, kernels/grouped_gemm_triton.py, kernels/gather_sum_triton.py)
against the PyTorch references, on the GPU machine. Skipped without CUDA (CI has none): run there with
``python3 -m pytest -m gpu tests/test_kernels_gpu.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"),
]

# Norm-relative error bounds: fp32 kernels use 3xTF32 dots (fp32-accurate on the tensor cores); bf16 operands keep
# 8 significant bits and the chunked path rounds several times in sequence (see test_kernels_gated_delta.py).
FP32_TOL = 1e-4
BF16_TOL = 2**-6
TF32_TOL = 2**-9  # fp32 inputs at float32 matmul precision "high": one TF32 product (10-bit mantissa) per dot
NAMES = ["o", "final_state", "dq", "dk", "dv", "dgate", "dbeta", "dh0"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device="cuda", generator=gen)
    raw = 3 * torch.randn(B, T, H, K, device="cuda", generator=gen)  # strong gates: in-tile decays near -80
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen)
    return q, k, v, raw, beta, h0


def run(fn, inputs, dtype, gate):
    """o, final state and grads of a random projection of both, w.r.t. q, k, v, the gate input, beta, h0.
    gate: "direct" (inputs[3] is the log-decay g), "fused" (raw logits, the kernel applies -5 sigmoid) or
    "graph" (raw logits, -5 sigmoid applied by torch before fn)."""
    q, k, v, gin, beta = [x.to(dtype).requires_grad_() for x in inputs[:5]]
    h0 = inputs[5].clone().requires_grad_()
    kw = dict(initial_state=h0, output_final_state=True)
    if gate == "fused":
        o, ht = fn(q, k, v, gin, beta, gate_lower_bound=-5.0, **kw)
    else:
        o, ht = fn(q, k, v, -5 * torch.sigmoid(gin) if gate == "graph" else gin, beta, **kw)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, device="cuda", generator=gen, dtype=torch.float64)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    grads = torch.autograd.grad(loss, (q, k, v, gin, beta, h0))
    return [o.detach(), ht.detach(), *grads]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("B, T, H, K, V, fused", [(2, 200, 3, 64, 64, True), (1, 300, 2, 128, 128, False)])
def test_chunk_triton_matches_recurrent(dtype, tol, B, T, H, K, V, fused):
    from kernels.gated_delta import recurrent_gated_delta_rule
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    inputs = list(make_inputs(B, T, H, K, V, seed=T + K))
    if not fused:
        inputs[3] = -5 * torch.sigmoid(inputs[3])  # the log-decay itself
    # reference in fp64 on the same rounded inputs (the state stays fp32)
    rounded = [x.to(dtype).double() for x in inputs[:5]] + [inputs[5].double()]
    ref = run(recurrent_gated_delta_rule, rounded, torch.float64, "graph" if fused else "direct")
    out = run(chunk_gated_delta_rule_triton, inputs, dtype, "fused" if fused else "direct")
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("i", range(8))
def test_every_autotuned_config_matches_recurrent(i, dtype, tol):
    """The autotuner may pick any of its configs on another GPU or shape: each state-kernel config it offers at
    this shape and precision (its early prune; the unpipelined ones run in test_head_dim_256's fp32 autotuning)
    and each pair-gradient and state-side config is checked on its own (config i of each list, cycling). A
    config that needs more shared memory than the GPU has is one the autotuner skips (it times it as infinite): in
    fp32, where 3xTF32 stages more, that ends the case; in bf16 every config must fit."""
    import triton

    import kernels.gated_delta_triton as gdt
    from kernels.gated_delta import recurrent_gated_delta_rule

    kernels = {gdt._state_fwd_kernel: gdt.STATE_CONFIGS, gdt._state_bwd_kernel: gdt.STATE_CONFIGS,
               gdt._bwd_pair_kernel: gdt.PAIR_CONFIGS, gdt._bwd_state_side_kernel: gdt.SIDE_CONFIGS}
    assert max(len(c) for c in kernels.values()) <= 8  # every config is reached by some i
    inputs = make_inputs(1, 300, 2, 128, 128, seed=i)
    rounded = [x.to(dtype).double() for x in inputs[:5]] + [inputs[5].double()]
    ref = run(recurrent_gated_delta_rule, rounded, torch.float64, "graph")
    cu = torch.tensor([0, 1, 64, 129, 300], device="cuda")  # the same tokens as a packed row (its own kernels)
    packed_inputs = [*inputs[:5], torch.randn(4, 2, 128, 128, device="cuda")]
    packed_ref = per_sequence_reference(packed_inputs, cu, dtype)
    from kernels.gated_delta_triton.chunk_fwd import _state_configs

    try:
        for kern, configs in kernels.items():
            if kern in (gdt._state_fwd_kernel, gdt._state_bwd_kernel):  # the configs offered at this shape, precision
                configs = _state_configs(configs, {"kd": inputs[1].to(dtype), "K": 128, "V": 128})
            kern.configs, kern.cache = [configs[i % len(configs)]], {}
        out = run(gdt.chunk_gated_delta_rule_triton, inputs, dtype, "fused")
        packed_out = run(lambda *xs, **kw: gdt.chunk_gated_delta_rule_triton(*xs, cu_seqlens=cu, **kw),
                         packed_inputs, dtype, "fused")
    except triton.runtime.errors.OutOfResources as e:
        if dtype != torch.float32:
            raise
        pytest.skip(f"config {i} does not fit in fp32 on this GPU: {e}")
    finally:
        for kern, configs in kernels.items():
            kern.configs, kern.cache = configs, {}
    for row, (got, want) in (("row", (out, ref)), ("packed", (packed_out, packed_ref))):
        for name, a, b in zip(NAMES, got, want):
            assert torch.isfinite(a).all(), (row, name)
            assert rel(a, b) < tol, (row, name, rel(a, b))


def test_chunk_triton_refuses_unsafe_inputs():
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    q, k, v, raw, beta, _ = make_inputs(1, 64, 1, 64, 64, seed=0)
    with pytest.raises(ValueError, match="log-decay below"):
        chunk_gated_delta_rule_triton(q, k, v, -F.softplus(raw) - 6, beta)
    with pytest.raises(ValueError, match="head dim K=32"):  # bf16 gradients went non-finite at K = 32
        chunk_gated_delta_rule_triton(q[..., :32], k[..., :32], v, raw[..., :32], beta, gate_lower_bound=-5.0)


@pytest.mark.parametrize("inplace", [False, True])
def test_decode_step_matches_reference(inplace):
    from kernels.gated_delta import gated_delta_rule_step
    from kernels.gated_delta_triton import gated_delta_rule_step_triton

    q, k, v, raw, beta, h0 = make_inputs(3, 1, 4, 128, 64, seed=1)
    g = -5 * torch.sigmoid(raw)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    o_ref, s_ref = gated_delta_rule_step(*args, h0.clone())
    state = h0.clone()
    o, s = gated_delta_rule_step_triton(*args, state, inplace=inplace)
    assert rel(o, o_ref) < FP32_TOL and rel(s, s_ref) < FP32_TOL
    assert (s.data_ptr() == state.data_ptr()) == inplace


@pytest.mark.parametrize("path, dtype, tol", [("triton", torch.float32, 2e-3), ("triton", torch.bfloat16, BF16_TOL),
                                             ("torch", torch.bfloat16, BF16_TOL)])
def test_grouped_mm_matches_loop(path, dtype, tol):
    from kernels.grouped_gemm import grouped_mm_reference, grouped_mm_torch
    from kernels.grouped_gemm_triton import grouped_mm_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 300, 5, 128, 0, 1000, 77, 1], device="cuda")  # empty and ragged experts
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    N, E, D, Fd = int(offsets[-1]), counts.numel(), 192, 320
    x = torch.randn(N, D, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(E, D, Fd, device="cuda", generator=gen) / D**0.5).to(dtype).requires_grad_()
    dy = torch.randn(N, Fd, device="cuda", generator=gen).to(dtype)
    y = (grouped_mm_triton if path == "triton" else grouped_mm_torch)(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = grouped_mm_reference(xr, wr, offsets)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    # fp32 dots run as tf32 on the tensor cores (~3e-4 expected)
    for name, a, b in (("y", y, yr), ("dx", dx, dxr), ("dw", dw, dwr)):
        assert rel(a, b) < tol, (name, rel(a, b))


# The two gather-sum cases and the 4,400-sequence row each held 21-25 GiB: beside each other and 5 more test workers
# they ran an H100 out of memory (run_gpu.sh runs the tests with --dist loadgroup: one worker takes the group).
BIG = pytest.mark.xdist_group("gpu-memory")


@BIG
@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_matches_reference(weighted):
    """The MoE's combine (weighted) and its dispatch's backward (not) at a 64K-token, top-4, hidden-2048 shape in
    bf16: the one-pass kernel against the PyTorch form in fp64 (the kernel sums in fp32, rounds once)."""
    from kernels.gather_sum import gather_sum_reference
    from kernels.gather_sum_triton import gather_sum_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    N, k, D = 65536 + 5, 4, 2048
    y = torch.randn(N * k, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    index = torch.randperm(N * k, device="cuda", generator=gen)
    w = torch.rand(N, k, device="cuda", generator=gen).requires_grad_() if weighted else None
    dout = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    leaves = [t for t in (y, w) if t is not None]
    out = gather_sum_triton(y, index, k, w)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = gather_sum_reference(ref_leaves[0], index, k, ref_leaves[1] if weighted else None)
    want = [ref, *torch.autograd.grad(ref, ref_leaves, dout.double())]
    for name, a, b in zip(["out", "dy", "dw"], got, want):
        assert rel(a, b) < 2**-8, (name, rel(a, b))  # one bf16 rounding of an fp32 sum


def per_sequence_reference(inputs, cu, dtype):
    """fp64 reference over each packed sequence on its own (inputs rounded to ``dtype`` first): the chunked
    PyTorch path in fp64 with ``cu_seqlens``, which tests/test_kernels_gated_delta.py holds equal to the
    recurrence (a 5K-token recurrent reference takes minutes of GPU time step by step)."""
    from kernels.chunked_gated_delta import chunk_gated_delta_rule

    def fn(q, k, v, g, beta, initial_state, output_final_state):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu)

    rounded = [x.to(dtype).double() for x in inputs[:5]] + [inputs[5].double()]
    return run(fn, rounded, torch.float64, "graph")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_packed_ragged_row_through_the_model_dispatch(dtype, tol):
    """Sequences of 1, 63, 65, 1000 and 4097 tokens in one row, each from its own initial state, through
    kernels.gated_delta_rule with the gate fused (the model's own path)."""
    import kernels

    lengths = [1, 63, 65, 1000, 4097]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v, raw, beta, _ = make_inputs(1, int(cu[-1]), 2, 128, 128, seed=5)
    h0 = torch.randn(len(lengths), 2, 128, 128, device="cuda")
    inputs = [q, k, v, raw, beta, h0]
    ref = per_sequence_reference(inputs, cu, dtype)

    def dispatch(*xs, initial_state, output_final_state, gate_lower_bound):
        return kernels.gated_delta_rule(*xs, initial_state=initial_state, output_final_state=output_final_state,
                                        gate_lower_bound=gate_lower_bound, cu_seqlens=cu)

    out = run(dispatch, inputs, dtype, "fused")
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))


def fused_kernel_matches_recurrent(inputs, dtype, tol) -> list[torch.Tensor]:
    from kernels.gated_delta import recurrent_gated_delta_rule
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    rounded = [x.to(dtype).double() for x in inputs[:5]] + [inputs[5].double()]
    ref = run(recurrent_gated_delta_rule, rounded, torch.float64, "graph")
    out = run(chunk_gated_delta_rule_triton, inputs, dtype, "fused")
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))
    return out


@pytest.mark.parametrize("K", [64, 256])
def test_fp32_follows_float32_matmul_precision(K):
    """fp32 inputs at precision "high" run one TF32 product per dot (fla's fp32 dots; about 3x less tensor-core
    work than the default's 3xTF32): within TF32_TOL of the reference, and not the default's numbers."""
    from kernels.gated_delta_triton import float32_matmul_precision

    inputs = make_inputs(1, 200, 2, K, K, seed=5)
    exact = fused_kernel_matches_recurrent(inputs, torch.float32, FP32_TOL)
    with float32_matmul_precision("high"):
        fast = fused_kernel_matches_recurrent(inputs, torch.float32, TF32_TOL)
    assert not torch.equal(exact[0], fast[0])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65])
def test_short_sequences(T, dtype, tol):
    """Lengths below and around one chunk. In bf16 a one-chunk row once faulted in the state kernel on the H200
    (Triton 3.6); the state passes now take at least MIN_STEPS steps per sequence."""
    fused_kernel_matches_recurrent(make_inputs(2, T, 2, 64, 64, seed=T), dtype, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_packed_short_sequences(dtype, tol):
    """The short lengths as one packed row: every sequence is its own program of the state passes."""
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    lengths = [1, 2, 63, 64, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v, raw, beta, _ = make_inputs(1, int(cu[-1]), 2, 64, 64, seed=11)
    inputs = [q, k, v, raw, beta, torch.randn(len(lengths), 2, 64, 64, device="cuda")]
    out = run(lambda *xs, **kw: chunk_gated_delta_rule_triton(*xs, cu_seqlens=cu, **kw), inputs, dtype, "fused")
    for name, a, b in zip(NAMES, out, per_sequence_reference(inputs, cu, dtype)):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))


@BIG
def test_packed_row_of_more_sequences_and_heads_than_a_grid_axis_holds():
    """4,400 sequences of 1-3 tokens with 16 heads: 70,400 (sequence, head) programs of the state passes, over
    a CUDA grid's y limit of 65,535 (they run on one flat axis)."""
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton

    lengths = ([1, 2, 3] * 1467)[:4400]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v, raw, beta, _ = make_inputs(1, int(cu[-1]), 16, 64, 64, seed=13)
    inputs = [q, k, v, raw, beta, torch.randn(len(lengths), 16, 64, 64, device="cuda")]
    out = run(lambda *xs, **kw: chunk_gated_delta_rule_triton(*xs, cu_seqlens=cu, **kw), inputs, torch.bfloat16,
              "fused")
    for name, a, b in zip(NAMES, out, per_sequence_reference(inputs, cu, torch.bfloat16)):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < BF16_TOL, (name, rel(a, b))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_head_dim_256(dtype, tol):
    fused_kernel_matches_recurrent(make_inputs(1, 200, 2, 256, 256, seed=3), dtype, tol)


def test_segmented_long_row_equals_whole_row(monkeypatch):
    """Rows over kernels.SEGMENT_TOKENS run segment by segment: the same outputs and gradients (fp32)."""
    import kernels

    lengths = [700, 100, 1300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v, raw, beta, _ = make_inputs(1, int(cu[-1]), 2, 64, 64, seed=9)
    inputs = [q, k, v, raw, beta, torch.randn(len(lengths), 2, 64, 64, device="cuda")]

    def dispatch(*xs, initial_state, output_final_state, gate_lower_bound):
        return kernels.gated_delta_rule(*xs, initial_state=initial_state, output_final_state=output_final_state,
                                        gate_lower_bound=gate_lower_bound, cu_seqlens=cu)

    whole = run(dispatch, inputs, torch.float32, "fused")
    monkeypatch.setattr(kernels, "SEGMENT_TOKENS", 512)
    for name, a, b in zip(NAMES, run(dispatch, inputs, torch.float32, "fused"), whole):
        assert rel(a, b) < 1e-5, (name, rel(a, b))
