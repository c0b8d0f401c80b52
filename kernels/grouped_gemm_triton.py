"""Triton grouped matrix multiply for MoE experts (one launch for all experts), with autograd.

    x       : [N, D]      rows sorted by expert; expert e owns rows offsets[e]:offsets[e+1]
    w       : [E, D, F]
    offsets : [E + 1]     int, offsets[0] = 0, offsets[E] = N
    returns : [N, F]

The M dimension is cut into BM-row tiles that never straddle two experts; a tile table (expert id and
first row per tile) is built on the GPU with no host sync, sized by the upper bound N / BM + E tiles
(unused tiles exit at once). Backward: dx = grouped_mm(dy, w^T) with the same kernel; dw[e] = x_e^T dy_e
with a second kernel that walks each expert's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM = 128  # rows per tile (fixed: the tile table depends on it)
BN, BK = 128, 64  # output columns per tile, reduction step (a standard Hopper tile: 128 x 128 x 64)


@triton.jit
def _grouped_mm_kernel(x, w, out, tile_expert, tile_row, offsets, D, F, s_we, s_wd, s_wf,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[rows of tile] = x[rows] @ w[e] for one BM x BN output tile."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert + pid_m)
    if e >= 0:
        row0 = tl.load(tile_row + pid_m)
        row_end = tl.load(offsets + e + 1)
        o_m = row0 + tl.arange(0, BM)
        o_n = pid_n * BN + tl.arange(0, BN)
        o_k = tl.arange(0, BK)
        m_m = o_m < row_end
        m_n = o_n < F
        p_x = x + o_m[:, None].to(tl.int64) * D + o_k[None, :]
        p_w = w + e.to(tl.int64) * s_we + o_k[:, None] * s_wd + o_n[None, :] * s_wf
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            m_k = (k0 + o_k) < D
            b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
            acc = tl.dot(b_x, b_w, acc)
            p_x += BK
            p_w += BK * s_wd
        p_o = out + o_m[:, None].to(tl.int64) * F + o_n[None, :]
        tl.store(p_o, acc.to(out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _grouped_wgrad_kernel(x, dy, dw, offsets, D, F, BD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """dw[e, d-tile, f-tile] = x[rows of e, d-tile]^T @ dy[rows of e, f-tile]  (reduction over rows)."""
    pid_d, pid_n, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(offsets + e)
    hi = tl.load(offsets + e + 1)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_r = tl.arange(0, BK)
    m_d = o_d < D
    m_n = o_n < F
    acc = tl.zeros([BD, BN], dtype=tl.float32)
    for r0 in range(lo, hi, BK):
        rows = (r0 + o_r).to(tl.int64)
        m_r = rows < hi
        b_x = tl.load(x + rows[None, :] * D + o_d[:, None], mask=m_d[:, None] & m_r[None, :], other=0.0)  # [BD, BK]
        b_dy = tl.load(dy + rows[:, None] * F + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(b_x, b_dy, acc)
    p = dw + e.to(tl.int64) * D * F + o_d[:, None] * F + o_n[None, :]
    tl.store(p, acc.to(dw.dtype.element_ty), mask=m_d[:, None] & m_n[None, :])


def _tile_table(offsets: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert id or -1, first row) for each of the N // BM + E possible tiles, computed on device."""
    E = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + BM - 1) // BM  # [E]
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(n_rows // BM + E, device=offsets.device)
    e = torch.searchsorted(cum, t, right=True)  # expert owning tile t (E when past the end)
    valid = e < E
    e_c = e.clamp(max=E - 1)
    row = offsets[e_c] + (t - (cum[e_c] - tiles[e_c])) * BM
    return torch.where(valid, e_c, -1).to(torch.int32), row.to(torch.int32)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    N, D = x.shape
    F = w.shape[-1]
    out = torch.empty(N, F, device=x.device, dtype=x.dtype)
    tile_expert, tile_row = _tile_table(offsets, N)
    grid = (tile_expert.numel(), triton.cdiv(F, BN))
    _grouped_mm_kernel[grid](x, w, out, tile_expert, tile_row, offsets, D, F, *w.stride(), BM=BM, BN=BN, BK=BK,
                             num_warps=8, num_stages=3)
    return out


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _grouped_mm(dy, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            E, D, F = w.shape
            dw = torch.empty_like(w)
            grid = (triton.cdiv(D, BM), triton.cdiv(F, BN), E)
            _grouped_wgrad_kernel[grid](x, dy, dw, offsets, D, F, BD=BM, BN=BN, BK=BK, num_warps=8, num_stages=3)
        return dx, dw, None


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul ``[N, D] x [E, D, F] -> [N, F]`` in one launch; same contract as
    ``kernels.grouped_gemm.grouped_mm_reference``; differentiable in x and w."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or offsets.numel() != w.shape[0] + 1:
        raise ValueError(f"expected x [N, D], w [E, D, F], offsets [E+1]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offsets.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    return _GroupedMM.apply(x.contiguous(), w.contiguous(), offsets.to(torch.int64).contiguous())
