"""Triton gather-sum (contract: kernels/gather_sum.py), with autograd.

    forward : out[n]            = sum_j w[n, j] * y[index[n*k + j]]       (fp32 sum)
    backward: dy[index[n*k + j]] = w[n, j] * dout[n]                      (index is a permutation: every row of dy
                                                                          written once, no atomics)
              dw[n, j]           = <dout[n], y[index[n*k + j]]>           (fp32)

The plain form materialises y[index] ([N*k, D], 1 GiB at 64K tokens, top-4, hidden 2048 in bf16), reads it again
for the weighted sum, and in backward writes the weighted gradient copy, reads y's copy for dw and gathers once
more. Here the forward reads y once and writes out; the backward reads dout and y once and writes dy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BD = 512  # hidden columns per tile
# tokens per program and warps, autotuned per (D, k): memory-bound either way, the best tile depends on the card
CONFIGS = [triton.Config({"BN": bn}, num_warps=w) for bn, w in ((8, 4), (16, 4), (32, 8))]


@triton.autotune(CONFIGS, key=["D", "K"])
@triton.jit
def _gather_sum_fwd_kernel(y, index, w, out, N, D, K: tl.constexpr, HAS_W: tl.constexpr,
                           BN: tl.constexpr, BD: tl.constexpr):
    """out[n-tile, d-tile] = sum_j w[n, j] * y[index[n*K + j], d-tile]."""
    pid_n, pid_d = tl.program_id(0), tl.program_id(1)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_d = pid_d * BD + tl.arange(0, BD)
    m_n = o_n < N
    m = m_n[:, None] & (o_d < D)[None, :]
    acc = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(K):
        rows = tl.load(index + o_n * K + j, mask=m_n, other=0).to(tl.int64)  # [BN]
        b = tl.load(y + rows[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BN, BD]
        if HAS_W:
            b *= tl.load(w + o_n * K + j, mask=m_n, other=0.0).to(tl.float32)[:, None]
        acc += b
    tl.store(out + o_n[:, None].to(tl.int64) * D + o_d[None, :], acc.to(out.dtype.element_ty), mask=m)


@triton.autotune(CONFIGS, key=["D", "K"])
@triton.jit
def _gather_sum_bwd_kernel(y, index, w, dout, dy, dw, N, D, K: tl.constexpr, KP: tl.constexpr,
                           HAS_W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """dy[index[n*K + j]] = w[n, j] * dout[n];  dw[n, j] = <dout[n], y[index[n*K + j]]>, over all of D."""
    pid_n = tl.program_id(0)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_j = tl.arange(0, KP)
    m_n = o_n < N
    m_nj = m_n[:, None] & (o_j < K)[None, :]
    rows = tl.load(index + o_n[:, None] * K + o_j[None, :], mask=m_nj, other=0).to(tl.int64)  # [BN, KP]
    if HAS_W:
        wt = tl.load(w + o_n[:, None] * K + o_j[None, :], mask=m_nj, other=0.0).to(tl.float32)  # [BN, KP]
    dots = tl.zeros([BN, KP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m = m_n[:, None] & (o_d < D)[None, :]
        g = tl.load(dout + o_n[:, None].to(tl.int64) * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            sel = (o_j == j)[None, :]
            r = tl.sum(tl.where(sel, rows, 0), axis=1)  # [BN] the row of slot j
            p = r[:, None] * D + o_d[None, :]
            if HAS_W:
                wj = tl.sum(tl.where(sel, wt, 0.0), axis=1)
                b = tl.load(y + p, mask=m, other=0.0).to(tl.float32)
                dots += tl.where(sel, tl.sum(g * b, axis=1)[:, None], 0.0)
                tl.store(dy + p, (g * wj[:, None]).to(dy.dtype.element_ty), mask=m)
            else:
                tl.store(dy + p, g.to(dy.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dw + o_n[:, None] * K + o_j[None, :], dots.to(dw.dtype.element_ty), mask=m_nj)


def _forward(y: torch.Tensor, index: torch.Tensor, k: int, weights: torch.Tensor | None) -> torch.Tensor:
    D = y.shape[-1]
    N = index.numel() // k
    out = torch.empty(N, D, device=y.device, dtype=y.dtype)
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(D, BD))  # noqa: E731
    _gather_sum_fwd_kernel[grid](y, index, weights, out, N, D, K=k, HAS_W=weights is not None, BD=BD)
    return out


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, index, k, weights):
        ctx.save_for_backward(y, index, weights)
        ctx.k = k
        return _forward(y, index, k, weights)

    @staticmethod
    def backward(ctx, dout):
        y, index, weights = ctx.saved_tensors
        k, (N, D) = ctx.k, dout.shape
        dout = dout.contiguous()
        dy = torch.empty_like(y)
        dw = None if weights is None else torch.empty_like(weights)
        _gather_sum_bwd_kernel[lambda meta: (triton.cdiv(N, meta["BN"]),)](
            y, index, weights, dout, dy, dw, N, D, K=k, KP=triton.next_power_of_2(k), HAS_W=weights is not None, BD=BD)
        return dy, None, None, dw


def gather_sum_triton(y: torch.Tensor, index: torch.Tensor, k: int,
                      weights: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.gather_sum.gather_sum_reference``'s contract in one pass; differentiable in y and weights."""
    if y.dim() != 2 or index.dim() != 1 or index.numel() != y.shape[0] or y.shape[0] % k:
        raise ValueError(f"expected y [N*k, D] and index [N*k] with k={k}; got {tuple(y.shape)}, {tuple(index.shape)}")
    if weights is not None and tuple(weights.shape) != (y.shape[0] // k, k):
        raise ValueError(f"weights must be [{y.shape[0] // k}, {k}], got {tuple(weights.shape)}")
    w = None if weights is None else weights.contiguous()
    return _GatherSum.apply(y.contiguous(), index.contiguous(), k, w)
