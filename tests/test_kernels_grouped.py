"""MoE grouped matmul: the reference equals per-expert matmuls (empty experts included); the dispatch takes it
on CPU."""

from __future__ import annotations

import torch

import kernels


def test_grouped_mm_reference_and_dispatch_on_cpu():
    gen = torch.Generator().manual_seed(0)
    E, D, F = 5, 8, 6
    counts = [3, 0, 4, 1, 0]  # empty experts in the middle and at the end
    offsets = torch.tensor([0] + counts).cumsum(0)
    x = torch.randn(sum(counts), D, generator=gen)
    w = torch.randn(E, D, F, generator=gen)
    expected = torch.cat([x[offsets[e] : offsets[e + 1]] @ w[e] for e in range(E)])
    assert torch.allclose(kernels.grouped_mm_reference(x, w, offsets), expected)
    assert torch.equal(kernels.grouped_mm(x, w, offsets), kernels.grouped_mm_reference(x, w, offsets))


def test_grouped_mm_torch_matches_reference_with_gradients():
    """``torch._grouped_mm`` under our contract (offsets from 0, empty experts, bf16), forward and both gradients
    against the fp64 reference: the path `kernels.grouped_mm` takes on Hopper GPUs, checked here on CPU."""
    gen = torch.Generator().manual_seed(1)
    E, D, F = 5, 32, 48
    counts = [7, 0, 16, 9, 0]
    offsets = torch.tensor([0] + counts).cumsum(0)
    x = torch.randn(sum(counts), D, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, D, F, generator=gen) / D**0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(counts), F, generator=gen).to(torch.bfloat16)
    y = kernels.grouped_mm_torch(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = kernels.grouped_mm_reference(xr, wr, offsets)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    for ours, ref in ((y, yr), (dx, dxr), (dw, dwr)):
        assert (ours.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert dw[1].abs().max() == 0 and dw[4].abs().max() == 0  # empty experts get no gradient
