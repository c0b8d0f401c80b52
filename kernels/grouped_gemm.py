"""Grouped matrix multiply for MoE experts: tokens sorted by expert, one GEMM per expert segment.

    x       : [N, D]      rows sorted so that expert e owns rows offsets[e]:offsets[e+1]
    w       : [E, D, F]   one weight matrix per expert
    offsets : [E + 1]     int64, offsets[0] = 0, offsets[E] = N
    returns : [N, F]

`grouped_mm_reference` is the plain PyTorch reference (a loop over experts, never over tokens);
`grouped_mm_torch` is PyTorch's own grouped GEMM (``torch._grouped_mm``: CUTLASS on Hopper, with its autograd
formula); `kernels.grouped_mm` dispatches to the fastest path available.
"""

from __future__ import annotations

import torch


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[-1])
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi] @ w[e]
    return out


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` with this module's contract (offsets [E + 1] from 0; it takes the E group ends as
    int32). Differentiable through torch's own formula, whose backward needs a contiguous output gradient."""
    return torch._grouped_mm(x, w, offs=offsets[1:].to(torch.int32))
