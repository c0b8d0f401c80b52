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
