"""Grouped matrix multiply for MoE experts: tokens sorted by expert, one GEMM per expert segment.

    x       : [N, D]      rows sorted so that expert e owns rows offsets[e]:offsets[e+1]
    w       : [E, D, F]   one weight matrix per expert
    offsets : [E + 1]     int64, offsets[0] = 0, offsets[E] = N
    returns : [N, F]

This is the plain PyTorch reference (a loop over experts, never over tokens); `kernels.grouped_mm`
dispatches to a fused GPU path where one is available.
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
