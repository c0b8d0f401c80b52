"""Chunked gated delta rule (kernels/chunked_gated_delta.py) against the recurrent reference, varlen packing,
decode continuation, and why the decay is lower-bounded (bf16 16-token tiles)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import chunk_gated_delta_rule, gated_delta_rule, gated_delta_rule_step, recurrent_gated_delta_rule

# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 of itself. The chunked path rounds in
# sequence the gated tile operands, (I + A)^-1, the written values u, the state cast for its products and o
# itself (gradients once more), and errors of the largest entries compound; allow 8 roundings' worth,
# 2^-6 (1.6 %) of the largest reference magnitude. Measured worst over 6 seeds: 0.9 %.
BF16_REL_TOL = 2**-6


def make_inputs(B=2, T=100, H=2, K=16, V=8, seed=0, gate="bounded"):
    """q, k L2-normalised; g bounded (-5 sigmoid) at strong magnitudes so in-tile decays reach -80."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    raw = 3 * torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.sigmoid(raw) if gate == "bounded" else -F.softplus(raw)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


def outputs_and_grads(fn, inputs, dtype, **kw):
    """Run fn on inputs cast to dtype (state stays fp32); return o, final state and the grads of a fixed
    random projection of both w.r.t. q, k, v, g, beta, initial_state, all as fp32."""
    q, k, v, g, beta, h0 = [x.to(dtype).requires_grad_() for x in inputs[:5]] + [inputs[5].clone().requires_grad_()]
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    grads = torch.autograd.grad(loss, (q, k, v, g, beta, h0))
    return [o.detach().float(), state.detach()] + [x.float() for x in grads]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


@pytest.mark.parametrize("T, chunk_size", [(100, 64), (75, 32)])
def test_chunked_matches_recurrent_fp32(T, chunk_size):
    inputs = make_inputs(T=T)  # T not a multiple of the chunk: the tail is padded
    ref = outputs_and_grads(recurrent_gated_delta_rule, inputs, torch.float32)
    out = outputs_and_grads(chunk_gated_delta_rule, inputs, torch.float32, chunk_size=chunk_size)
    for name, a, b in zip(NAMES, ref, out):
        err = (a - b).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs error {err:.2e} > 1e-5 (max |ref| {a.abs().max():.2f})"


def test_chunked_matches_recurrent_bf16():
    inputs = make_inputs(T=100)
    # Reference: the recurrent form in fp32 on the same bf16-rounded inputs, so only the chunked path's
    # bf16 tile products and roundings are measured.
    rounded = [x.bfloat16().float() for x in inputs[:5]] + [inputs[5]]
    ref = outputs_and_grads(recurrent_gated_delta_rule, rounded, torch.float32)
    out = outputs_and_grads(chunk_gated_delta_rule, inputs, torch.bfloat16)
    for name, a, b in zip(NAMES, ref, out):
        err, scale = (a - b).abs().max().item(), a.abs().max().item()
        assert err <= BF16_REL_TOL * scale, f"{name}: max abs error {err:.2e} > {BF16_REL_TOL} * {scale:.2f}"


@pytest.mark.parametrize("pad_waste", [float("inf"), 0.0], ids=["padded-batch", "laid-out-row"])
def test_cu_seqlens_equals_separate_sequences(pad_waste, monkeypatch):
    monkeypatch.setattr("kernels.chunked_gated_delta.PAD_WASTE", pad_waste)  # both layouts of packed sequences
    lengths = [5, 70, 16, 90]  # shorter than a tile, over a chunk, exactly a tile, two chunks with a tail
    q, k, v, g, beta, _ = make_inputs(B=1, T=sum(lengths))
    h0 = torch.randn(len(lengths), 2, 16, 8, generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.shape == v.shape and state.shape == h0.shape
    for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        seg = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_ref, s_ref = recurrent_gated_delta_rule(*seg, initial_state=h0[i : i + 1], output_final_state=True)
        assert (o[:, lo:hi] - o_ref).abs().max() <= 1e-5, f"sequence {i}: outputs differ"
        assert (state[i : i + 1] - s_ref).abs().max() <= 1e-5, f"sequence {i}: final states differ"


def test_decode_steps_continue_chunked_prefill():
    q, k, v, g, beta, h0 = make_inputs(T=90)
    prefill = 70
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _, state = chunk_gated_delta_rule(
        *(x[:, :prefill] for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True
    )
    for t in range(prefill, q.shape[1]):
        o_t, state = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert state.dtype == torch.float32
        err = (o_t - o_full[:, t]).abs().max().item()
        assert err <= 1e-5, f"token {t}: decode step differs from the full chunked forward by {err:.2e}"
    assert (state - s_full).abs().max() <= 1e-5


def test_bounded_gate_keeps_bf16_tiles_finite_softplus_does_not():
    """Same raw gate logits at realistic magnitudes (per-channel offsets with std 4 plus per-token noise, as a
    trained gate has fast- and slow-forgetting channels): -softplus lets fast channels decay by far more
    than 88 within 16 tokens, so the tile's reciprocal decay exp(-cumsum g) overflows; -5 * sigmoid bounds
    the in-tile decay at -80 and the bf16 chunked form stays close to the fp32 recurrent reference."""
    B, T, H, K, V = 1, 64, 2, 32, 16
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    raw = 4 * torch.randn(H, K, generator=gen) + torch.randn(B, T, H, K, generator=gen)

    def run(g):
        min_tile_sum = g.unflatten(1, (T // 16, 16)).sum(2).min().item()
        ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta)  # fp32
        o, _ = chunk_gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)))
        o = o.float()
        finite = bool(o.isfinite().all())
        err = (o - ref).abs().max().item() if finite else float("inf")
        return min_tile_sum, finite, err, BF16_REL_TOL * ref.abs().max().item()

    tile_sum, finite, err, tol = run(-F.softplus(raw))
    assert tile_sum < -88, f"setup: softplus 16-token decay only reaches {tile_sum:.1f}, exp(-cumsum) would not overflow"
    assert not finite or err > 10 * tol, f"softplus gate stayed finite and close: err {err:.2e} (tol {tol:.2e}), min tile decay {tile_sum:.1f}"

    tile_sum, finite, err, tol = run(-5 * torch.sigmoid(raw))
    assert tile_sum >= -80, f"bounded gate's 16-token decay {tile_sum:.1f} < -80"
    assert finite and err <= tol, f"bounded gate: finite={finite}, max abs error {err:.2e} > tol {tol:.2e}"


def test_exact_diagonal_handles_the_unbounded_gate():
    """-softplus at strong magnitudes (16-token decays far below -88): the factorised tiles give nan, the exact
    diagonal tiles match the recurrent reference in fp32 (forward and gradients), and the dispatch takes them
    when told the gate is unbounded."""
    q, k, v, _, beta, h0 = make_inputs(T=96)
    gen = torch.Generator().manual_seed(1)
    g = -F.softplus(4 * torch.randn(2, 16, generator=gen) + torch.randn(2, 96, 2, 16, generator=gen))
    inputs = (q, k, v, g, beta, h0)
    assert g.unflatten(1, (-1, 16)).sum(2).min() < -88  # the in-tile reciprocal decay overflows
    factorised, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert not factorised.isfinite().all()
    ref = outputs_and_grads(recurrent_gated_delta_rule, inputs, torch.float32)
    out = outputs_and_grads(chunk_gated_delta_rule, inputs, torch.float32, exact_diagonal=True)
    for name, a, b in zip(NAMES, ref, out):
        err = (a - b).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs error {err:.2e} > 1e-5 (max |ref| {a.abs().max():.2f})"
    o, _ = gated_delta_rule(q, k, v, g, beta, initial_state=h0, bounded_gate=False)
    assert torch.allclose(o, ref[0], atol=1e-5)


def test_dispatch_runs_chunked_form_on_cpu():
    q, k, v, g, beta, h0 = make_inputs(T=40)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_bad_inputs_raise():
    q, k, v, g, beta, h0 = make_inputs(T=20)
    with pytest.raises(ValueError, match="<= 0"):
        chunk_gated_delta_rule(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 20]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0, cu_seqlens=torch.tensor([0, 5, 10, 20]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=40)
