"""Gather-sum: the k rows of each token, picked out of a row-permuted tensor, weighted and summed. The MoE's combine
(expert outputs in expert order back to their tokens) and its dispatch's backward (the gradients of each token's k
copies summed) are both this op.

    y       : [N * k, D]  rows in some order (expert order in the MoE)
    index   : [N * k]     int64, a permutation of range(N * k): the row of y holding slot (n, j), token-major
    weights : [N, k]      per-slot weights (fp32 in the MoE), or None for all ones
    returns : [N, D]      out[n] = sum_j weights[n, j] * y[index[n * k + j]]      (y's dtype)

`gather_sum_reference` is the plain PyTorch form: the [N * k, D] token-major copy of y materialised, then the
weighted sum. `kernels.gather_sum` takes the Triton kernel on CUDA (kernels/gather_sum_triton.py), which reads each
row of y once, sums in fp32 and never writes that copy, forward or backward.
"""

from __future__ import annotations

import torch


def gather_sum_reference(y: torch.Tensor, index: torch.Tensor, k: int,
                         weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * y[index[n * k + j]] (see the module docstring); differentiable in y and
    weights through PyTorch's autograd."""
    rows = y[index].view(-1, k, y.shape[-1])  # [N, k, D] token-major
    if weights is not None:
        rows = rows * weights[..., None].to(y.dtype)
    return rows.sum(1)
