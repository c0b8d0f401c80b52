"""Triton kernels for the gated delta rule (KDA-style linear attention) on the GPU.

Chunked form (chunk ``BT = 64``, sub-tiles of ``BC = 16`` tokens), per head, inside chunk ``n`` with
start state ``S`` [K, V] and chunk-local cumulative log-decay ``G_t = sum_{s<=t} g_s`` (per key channel):

    Akk[i, j] = beta_i * sum_c k_i k_j exp(G_i - G_j)       j <  i   (strictly lower)
    Aqk[t, i] = scale  * sum_c q_t k_i exp(G_t - G_i)       i <= t
    T  = (I + Akk)^-1
    w  = T diag(beta) (k * exp(G))        u = T diag(beta) v          (WY form)
    U  = u - w S                                                       ("new values")
    o  = scale * (q * exp(G)) S + Aqk U
    S' = diag(exp(G_L)) S + (k * exp(G_L - G))^T U                     (G_L: last row of the chunk)

The per-channel factors ``exp(G_t - G_i)`` are split through a reference row ``r`` so every pair term is a
tensor-core matmul: ``(q_t exp(G_t - G_r)) . (k_i exp(G_r - G_i))``. With the bounded gate
``g >= -5`` the factors stay inside fp32's exponent range within a 16-token sub-tile (``<= exp(80)``),
which is why the wrapper refuses decays below ``G_MIN_SAFE``.

Forward kernels: gate + cumsum -> pair matrices -> blocked triangular inverse + WY (also writes
kd = k exp(G_L - G) and qg = scale q exp(G)) -> sequential state pass -> output. Backward: Aqk^T dO ->
sequential reverse state pass -> value-side grads -> state-side grads -> dAkk -> pair-matrix grads (one
program per 16-row sub-tile) -> dg, the chunk's reverse cumsum of dG. Only the state is carried through the
two sequential kernels; everything else is prepared by parallel kernels. Intermediates are kept from the
forward (no recompute). The pair products take fp32 operands (tf32 for 16-bit inputs): the gate gradient is
a difference of nearly equal terms and bf16 operands there cost a 10x larger error
(benchmarks/kernels/NOTES.md). Plain pointer arithmetic throughout, so the kernels also run under Triton's
CPU interpreter (tests/test_kernels_triton_interpret.py).

Shapes (as in ``kernels/gated_delta.py``): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V] fp32. K and V must be 64, 128 or 256 (64 and 128 tested).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CHUNK = 64  # chunk length
BT = tl.constexpr(CHUNK)  # the same, as the kernels see it
BC = tl.constexpr(16)  # sub-tile length: one reference row per 16 tokens keeps exp() finite
G_MIN_SAFE = -5.5  # 15 steps * 5.5 = 82.5 < log(fp32 max) ~ 88.7
FIRST = tl.constexpr(1)  # chunk_flags bits (packed rows): the chunk starts a sequence
LAST = tl.constexpr(2)  # ... the chunk ends a sequence


# ----------------------------------------------------------------------------------------------------
# tile helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _tile(X, row0, n_rows, stride, col0, R: tl.constexpr, C: tl.constexpr):
    """Pointers (or offsets, for an integer X) [R, C] to rows row0.. and columns col0.. of a row-major view
    with row stride ``stride``, and the [R, 1] mask of the rows below ``n_rows``."""
    o_r = row0 + tl.arange(0, R)
    return X + o_r[:, None] * stride + col0 + tl.arange(0, C)[None, :], (o_r < n_rows)[:, None]


@triton.jit
def _load16(A, r0, c0, n, RS: tl.constexpr):
    o = tl.arange(0, 16)
    return tl.load(A + (r0 + o)[:, None] * RS + c0 + o[None, :], mask=((r0 + o) < n)[:, None], other=0.0)


@triton.jit
def _store16(X, b_x, r0, c0, n, RS: tl.constexpr):
    o = tl.arange(0, 16)
    tl.store(X + (r0 + o)[:, None] * RS + c0 + o[None, :], b_x, mask=((r0 + o) < n)[:, None])


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")  # exact fp32 (the inverse's small blocks)


@triton.jit
def _substitution_row(A, X, i, r0, n, RS: tl.constexpr):
    """Row i of (I + A_bb)^-1's strictly lower part for the 16x16 diagonal block at rows/cols r0..r0+15,
    given the rows before it in X: -A[i, :i] - A[i, :] X."""
    o = tl.arange(0, 16)
    b_a = -tl.load(A + (r0 + i) * RS + r0 + o, mask=(o < i) & (o * 0 + r0 + i < n), other=0.0)
    b_a += tl.sum(b_a[:, None] * X, 0)
    return tl.where((o == i)[:, None], b_a[None, :], X)


@triton.jit
def _diagonal_inverses16(A, n, RS: tl.constexpr):
    """(I + A_bb)^-1 of the four 16x16 diagonal blocks of a strictly lower [BT, BT] tile at ``A`` (row stride
    RS, ``n`` valid rows) by forward substitution, the four blocks in one loop so their rows overlap. 4 x [16, 16]."""
    o = tl.arange(0, 16)
    m_low = o[:, None] > o[None, :]
    b_X0 = -tl.where(m_low, _load16(A, 0, 0, n, RS), 0.0)  # rows 0 and 1 of each block are final
    b_X1 = -tl.where(m_low, _load16(A, 16, 16, n, RS), 0.0)
    b_X2 = -tl.where(m_low, _load16(A, 32, 32, n, RS), 0.0)
    b_X3 = -tl.where(m_low, _load16(A, 48, 48, n, RS), 0.0)
    for i in range(2, 16):
        b_X0 = _substitution_row(A, b_X0, i, 0, n, RS)
        b_X1 = _substitution_row(A, b_X1, i, 16, n, RS)
        b_X2 = _substitution_row(A, b_X2, i, 32, n, RS)
        b_X3 = _substitution_row(A, b_X3, i, 48, n, RS)
    b_I = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    return b_X0 + b_I, b_X1 + b_I, b_X2 + b_I, b_X3 + b_I


# ----------------------------------------------------------------------------------------------------
# forward kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _gate_cumsum_kernel(g, G, lower_bound, T, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr):
    """G[chunk] = cumsum over the chunk of g (or of lower_bound * sigmoid(g) when GATE). [BT, K] fp32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    kb = (i_b * T * H + i_h) * K
    p_x, m_t = _tile(kb, i_t * BT, T, H * K, 0, BT, K)
    b_g = tl.load(g + p_x, mask=m_t, other=0.0).to(tl.float32)  # [BT, K]
    if GATE:
        b_g = tl.where(m_t, lower_bound * tl.sigmoid(b_g), 0.0)
    tl.store(G + p_x, tl.cumsum(b_g, axis=0), mask=m_t)


@triton.jit
def _pair_matrices_kernel(q, k, G, beta, Aqk, Akk, scale, T, H: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """Aqk [BT, BT] (incl. diagonal, times scale) and Akk [BT, BT] (strictly lower, times beta_i), one
    16-row sub-tile at a time with reference row r = first row of the sub-tile. fp32 operands (tf32 on
    the tensor cores for 16-bit inputs): the decay factors span e^{+-75} inside a sub-tile."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    kb = (i_b * T * H + i_h) * K
    ab = (i_b * T * H + i_h) * BT
    o_j = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    p_x, m_j = _tile(kb, t0, T, H * K, 0, BT, K)  # offsets of all rows of the chunk
    b_k = tl.load(k + p_x, mask=m_j, other=0.0).to(tl.float32)  # [BT, K] all keys of the chunk
    b_G = tl.load(G + p_x, mask=m_j, other=0.0)
    for i_c in tl.static_range(BT // BC):
        r0 = i_c * BC
        if t0 + r0 < T:
            b_Gr = tl.load(G + kb + (t0 + r0) * H * K + o_k)  # [K]
            p_c, m_c = _tile(kb, t0 + r0, T, H * K, 0, BC, K)
            f_c = tl.exp(tl.where(m_c, tl.load(G + p_c, mask=m_c, other=0.0) - b_Gr[None, :], 0.0))  # <= 1
            b_qc = tl.load(q + p_c, mask=m_c, other=0.0).to(tl.float32) * f_c  # [BC, K]
            b_kc = tl.load(k + p_c, mask=m_c, other=0.0).to(tl.float32) * f_c
            # keys j < r0 + BC, decayed to the reference row; later keys are masked (they would overflow)
            m_col = m_j & (o_j < r0 + BC)[:, None]
            b_kj = tl.where(m_col, b_k * tl.exp(tl.where(m_col, b_Gr[None, :] - b_G, 0.0)), 0.0)
            b_aqk = tl.dot(b_qc, tl.trans(b_kj), input_precision=PREC)  # [BC, BT]
            b_akk = tl.dot(b_kc, tl.trans(b_kj), input_precision=PREC)
            o_i = r0 + tl.arange(0, BC)
            b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=(t0 + o_i) < T, other=0.0).to(tl.float32)
            b_aqk = tl.where(o_j[None, :] <= o_i[:, None], b_aqk * scale, 0.0)
            b_akk = tl.where(o_j[None, :] < o_i[:, None], b_akk * b_b[:, None], 0.0)
            p_a, m_a = _tile(ab, t0 + r0, T, H * BT, 0, BC, BT)
            tl.store(Aqk + p_a, b_aqk, mask=m_a)
            tl.store(Akk + p_a, b_akk, mask=m_a)


@triton.jit
def _solve_wy_kernel(q, k, v, G, beta, Akk, Tinv, w, u, kd, qg, scale, T, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Tinv = (I + Akk)^-1 by blocks: four 16x16 diagonal inverses (forward substitution), the six blocks
    below them by exact fp32 matmuls (X_ij = -X_ii sum_{j<=m<i} A_im X_mj). Then, for the later kernels,
    w = Tinv (beta k exp(G)) [BT, K], u = Tinv (beta v) [BT, V], kd = k exp(G_L - G) and qg = scale q exp(G)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    n = T - t0  # valid rows in this chunk (may exceed BT)
    RS: tl.constexpr = H * BT
    A = Akk + (i_b * T * H + i_h) * BT + t0 * RS
    X = Tinv + (i_b * T * H + i_h) * BT + t0 * RS
    b_X00, b_X11, b_X22, b_X33 = _diagonal_inverses16(A, n, RS)
    b_A10 = _load16(A, 16, 0, n, RS)
    b_A20 = _load16(A, 32, 0, n, RS)
    b_A21 = _load16(A, 32, 16, n, RS)
    b_A30 = _load16(A, 48, 0, n, RS)
    b_A31 = _load16(A, 48, 16, n, RS)
    b_A32 = _load16(A, 48, 32, n, RS)
    b_X10 = -_mm(b_X11, _mm(b_A10, b_X00))
    b_X21 = -_mm(b_X22, _mm(b_A21, b_X11))
    b_X32 = -_mm(b_X33, _mm(b_A32, b_X22))
    b_X20 = -_mm(b_X22, _mm(b_A20, b_X00) + _mm(b_A21, b_X10))
    b_X31 = -_mm(b_X33, _mm(b_A31, b_X11) + _mm(b_A32, b_X21))
    b_X30 = -_mm(b_X33, _mm(b_A30, b_X00) + _mm(b_A31, b_X10) + _mm(b_A32, b_X20))
    b_0 = tl.zeros([16, 16], dtype=tl.float32)
    _store16(X, b_X00, 0, 0, n, RS)
    _store16(X, b_0, 0, 16, n, RS)
    _store16(X, b_0, 0, 32, n, RS)
    _store16(X, b_0, 0, 48, n, RS)
    _store16(X, b_X10, 16, 0, n, RS)
    _store16(X, b_X11, 16, 16, n, RS)
    _store16(X, b_0, 16, 32, n, RS)
    _store16(X, b_0, 16, 48, n, RS)
    _store16(X, b_X20, 32, 0, n, RS)
    _store16(X, b_X21, 32, 16, n, RS)
    _store16(X, b_X22, 32, 32, n, RS)
    _store16(X, b_0, 32, 48, n, RS)
    _store16(X, b_X30, 48, 0, n, RS)
    _store16(X, b_X31, 48, 16, n, RS)
    _store16(X, b_X32, 48, 32, n, RS)
    _store16(X, b_X33, 48, 48, n, RS)
    tl.debug_barrier()  # Tinv's blocks, written by all threads above, are read back whole below
    o_i = tl.arange(0, BT)
    m_t = o_i < n
    b_T = tl.load(X + o_i[:, None] * RS + o_i[None, :], mask=m_t[:, None], other=0.0).to(k.dtype.element_ty)
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    kb = (i_b * T * H + i_h) * K
    last = tl.minimum(n, BT) - 1
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_x = kb + (t0 + o_i)[:, None] * H * K + o_k[None, :]
        b_G = tl.load(G + p_x, mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_GL = tl.load(G + kb + (t0 + last) * H * K + o_k)  # [BK]
        b_k = tl.load(k + p_x, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_x = (b_k * tl.exp(b_G) * b_b[:, None]).to(k.dtype.element_ty)
        tl.store(w + p_x, tl.dot(b_T, b_x, input_precision=PREC).to(w.dtype.element_ty), mask=m_t[:, None])
        b_kd = b_k * tl.exp(tl.where(m_t[:, None], b_GL[None, :] - b_G, 0.0))
        tl.store(kd + p_x, b_kd.to(kd.dtype.element_ty), mask=m_t[:, None])
        b_qg = tl.load(q + p_x, mask=m_t[:, None], other=0.0).to(tl.float32) * tl.exp(b_G) * scale
        tl.store(qg + p_x, b_qg.to(qg.dtype.element_ty), mask=m_t[:, None])
    vb = (i_b * T * H + i_h) * V
    for i_v in tl.static_range(V // BV):
        p_v = vb + (t0 + o_i)[:, None] * H * V + i_v * BV + tl.arange(0, BV)[None, :]
        b_v = (tl.load(v + p_v, mask=m_t[:, None], other=0.0).to(tl.float32) * b_b[:, None]).to(v.dtype.element_ty)
        tl.store(u + p_v, tl.dot(b_T, b_v, input_precision=PREC).to(u.dtype.element_ty), mask=m_t[:, None])


# The two sequential kernels run one (batch, head, V-slice) per program, chunk after chunk: the slice width
# trades programs (SMs in use) against work per step, and a third pipeline stage loads the next chunk's
# operands earlier (-0.8 ms of 15.8 at 64K tokens, benchmarks/kernels/NOTES.md; BV = 64 with 3 stages needs
# 256 KiB of shared memory in fp32). 4 warps: with 2 the state kernels spill heavily (and one such config
# crashed on the H200).
STATE_CONFIGS = [triton.Config({"BV": bv}, num_warps=4, num_stages=ns) for bv, ns in ((16, 2), (32, 2), (64, 2),
                                                                                    (16, 3), (32, 3))]


@triton.autotune(configs=STATE_CONFIGS, key=["H", "K", "V"])
@triton.jit
def _state_fwd_kernel(kd, G, w, u, h, U, h0, ht, chunk_seq, chunk_flags, T, NT, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                      VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Sequential pass over chunks for one (batch, head, V-slice): stores the chunk-start states
    h [B, NT, H, K, V] and U = u - w S [B, T, H, V]; S' = exp(G_L) S + kd^T U. Only the state is
    carried between steps; every other operand was prepared by the parallel kernels.
    VARLEN (B = 1, sequences chunk-aligned): chunk n belongs to sequence chunk_seq[n]; the state is reset to
    that sequence's h0 (or zero) where chunk_flags[n] has FIRST and its final state is stored where LAST."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, K)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    o_s, _ = _tile(0, 0, K, V, i_v * BV, K, BV)  # this V-slice of one [K, V] state
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0 and not VARLEN:
        b_h = tl.load(h0 + i_bh * K * V + o_s)
    for i_t in range(NT):
        t0 = i_t * BT
        if VARLEN:
            f_t = tl.load(chunk_flags + i_t)
            p_n = (tl.load(chunk_seq + i_t).to(tl.int64) * H + i_h) * K * V + o_s  # this sequence's state slice
            if (f_t & FIRST) != 0:
                if HAS_H0:
                    b_h = tl.load(h0 + p_n)
                else:
                    b_h = tl.zeros([K, BV], dtype=tl.float32)
        tl.store(h + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V + o_s, b_h.to(h.dtype.element_ty))
        p_x, m_t = _tile(kb, t0, T, H * K, 0, BT, K)
        p_y, m_y = _tile(vb, t0, T, H * V, i_v * BV, BT, BV)
        b_w = tl.load(w + p_x, mask=m_t, other=0.0)  # [BT, K]
        b_kd = tl.load(kd + p_x, mask=m_t, other=0.0)
        b_GL = tl.load(G + kb + (tl.minimum(t0 + BT, T) - 1) * H * K + o_k)  # [K]
        b_U = tl.load(u + p_y, mask=m_y, other=0.0).to(tl.float32)
        b_U -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)  # [BT, BV]
        tl.store(U + p_y, b_U.to(U.dtype.element_ty), mask=m_y)
        b_h = b_h * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_kd), b_U.to(b_kd.dtype), input_precision=PREC)
        if VARLEN and STORE_HT:
            if (f_t & LAST) != 0:
                tl.store(ht + p_n, b_h)
    if STORE_HT and not VARLEN:
        tl.store(ht + i_bh * K * V + o_s, b_h)


@triton.jit
def _output_kernel(qg, h, Aqk, U, o, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr):
    """o = qg S + Aqk U   (qg = scale q exp(G)) for one chunk and one V-slice."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    p_q, m_t = _tile(qg + (i_b * T * H + i_h) * K, t0, T, H * K, 0, BT, K)
    p_h, _ = _tile(h + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V, 0, K, V, i_v * BV, K, BV)
    b_o = tl.dot(tl.load(p_q, mask=m_t, other=0.0), tl.load(p_h).to(qg.dtype.element_ty), input_precision=PREC)
    p_A, _ = _tile(Aqk + (i_b * T * H + i_h) * BT, t0, T, H * BT, 0, BT, BT)
    p_U, _ = _tile((i_b * T * H + i_h) * V, t0, T, H * V, i_v * BV, BT, BV)
    b_o += tl.dot(tl.load(p_A, mask=m_t, other=0.0).to(U.dtype.element_ty), tl.load(U + p_U, mask=m_t, other=0.0),
                  input_precision=PREC)
    tl.store(o + p_U, b_o.to(o.dtype.element_ty), mask=m_t)


# ----------------------------------------------------------------------------------------------------
# backward kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_intra_dU_kernel(Aqk, do, dU, T, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dU = Aqk^T dO: the part of dU that does not depend on the state gradient (fp32 [B, T, H, V])."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    p_A, m_t = _tile(Aqk + (i_b * T * H + i_h) * BT, t0, T, H * BT, 0, BT, BT)
    p_y, _ = _tile((i_b * T * H + i_h) * V, t0, T, H * V, i_v * BV, BT, BV)
    b_dU = tl.dot(tl.trans(tl.load(p_A, mask=m_t, other=0.0).to(do.dtype.element_ty)),
                  tl.load(do + p_y, mask=m_t, other=0.0), input_precision=PREC)
    tl.store(dU + p_y, b_dU, mask=m_t)


@triton.autotune(configs=STATE_CONFIGS, key=["H", "K", "V"], restore_value=["dU"])
@triton.jit
def _state_bwd_kernel(qg, kd, G, w, do, dh, dU, dht, dh0, chunk_seq, chunk_flags, T, NT, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Reverse sequential pass. dh[n] = dL/d(state at the end of chunk n) [B, NT, H, K, V];
    dU += kd dS' (dU holds Aqk^T dO on entry);  dS = exp(G_L) dS' + qg^T dO - w^T dU.
    VARLEN: the state gradient restarts from the sequence's dht (or zero) at its LAST chunk and is stored as
    its dh0 after its FIRST chunk."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, K)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    o_s, _ = _tile(0, 0, K, V, i_v * BV, K, BV)  # this V-slice of one [K, V] state
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_DHT and not VARLEN:
        b_dh = tl.load(dht + i_bh * K * V + o_s)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        t0 = i_t * BT
        if VARLEN:
            f_t = tl.load(chunk_flags + i_t)
            p_n = (tl.load(chunk_seq + i_t).to(tl.int64) * H + i_h) * K * V + o_s  # this sequence's state slice
            if (f_t & LAST) != 0:
                if HAS_DHT:
                    b_dh = tl.load(dht + p_n)
                else:
                    b_dh = tl.zeros([K, BV], dtype=tl.float32)
        tl.store(dh + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V + o_s, b_dh.to(dh.dtype.element_ty))
        p_x, m_t = _tile(kb, t0, T, H * K, 0, BT, K)
        p_y, m_y = _tile(vb, t0, T, H * V, i_v * BV, BT, BV)
        b_kd = tl.load(kd + p_x, mask=m_t, other=0.0)  # [BT, K]
        b_qg = tl.load(qg + p_x, mask=m_t, other=0.0)
        b_w = tl.load(w + p_x, mask=m_t, other=0.0)
        b_do = tl.load(do + p_y, mask=m_y, other=0.0)  # [BT, BV]
        b_GL = tl.load(G + kb + (tl.minimum(t0 + BT, T) - 1) * H * K + o_k)  # [K]
        b_dU = tl.load(dU + p_y, mask=m_y, other=0.0)
        b_dU += tl.dot(b_kd, b_dh.to(b_kd.dtype), input_precision=PREC)  # [BT, BV]
        tl.store(dU + p_y, b_dU, mask=m_y)
        b_dh = b_dh * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(b_qg.dtype), input_precision=PREC)
        b_dh -= tl.dot(tl.trans(b_w), b_dU.to(b_w.dtype), input_precision=PREC)
        if VARLEN and STORE_DH0:
            if (f_t & FIRST) != 0:
                tl.store(dh0 + p_n, b_dh)
    if STORE_DH0 and not VARLEN:
        tl.store(dh0 + i_bh * K * V + o_s, b_dh)


@triton.jit
def _bwd_value_kernel(v, beta, Tinv, U, dU, do, dv, dAqk, dT, dbeta, T, H: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: dAqk = dO U^T (masked i <= t), dT = dU (beta v)^T, dv = beta Tinv^T dU,
    dbeta = sum_v (Tinv^T dU) v. Writes dT and dbeta (later kernels add to them)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    m_t = (t0 + o_i) < T
    vb = (i_b * T * H + i_h) * V
    ab = (i_b * T * H + i_h) * BT
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    p_A, m_a = _tile(ab, t0, T, H * BT, 0, BT, BT)
    b_Tt = tl.trans(tl.load(Tinv + p_A, mask=m_a, other=0.0)).to(v.dtype.element_ty)  # Tinv^T
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in tl.static_range(V // BV):
        p_y, m_y = _tile(vb, t0, T, H * V, i_v * BV, BT, BV)
        b_v = tl.load(v + p_y, mask=m_y, other=0.0)
        b_dU = tl.load(dU + p_y, mask=m_y, other=0.0).to(v.dtype.element_ty)  # fp32 -> operand dtype
        b_dA += tl.dot(tl.load(do + p_y, mask=m_y, other=0.0), tl.trans(tl.load(U + p_y, mask=m_y, other=0.0)),
                       input_precision=PREC)
        b_bv = (b_v.to(tl.float32) * b_b[:, None]).to(v.dtype.element_ty)
        b_dT += tl.dot(b_dU, tl.trans(b_bv), input_precision=PREC)
        b_du = tl.dot(b_Tt, b_dU, input_precision=PREC)  # [BT, BV] grad of beta v
        b_db += tl.sum(b_du * b_v.to(tl.float32), 1)
        tl.store(dv + p_y, (b_du * b_b[:, None]).to(dv.dtype.element_ty), mask=m_y)
    tl.store(dAqk + p_A, tl.where(o_i[None, :] <= o_i[:, None], b_dA, 0.0), mask=m_a)
    tl.store(dT + p_A, b_dT, mask=m_a)
    tl.store(dbeta + (i_b * T + t0 + o_i) * H + i_h, b_db, mask=m_t)


@triton.jit
def _bwd_state_side_kernel(q, k, G, beta, Tinv, h, dh, U, dU, do, dq_p, dk_p, dG_p, dT, dbeta, scale, T, NT,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           PREC: tl.constexpr):
    """Per chunk and K-slice, the gradients that flow through the states: dQg = dO S^T, dw = -dU S^T,
    dKd = U dS'^T, the decay of S, and the WY input x = beta k exp(G) (dx = Tinv^T dw, dT += dw x^T).
    Writes partial dq, dk, dG [B, T, H, K] fp32; adds into dT and dbeta."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = (t0 + o_i) < T
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    ab = (i_b * T * H + i_h) * BT
    hb = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in tl.static_range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_s = hb + o_v[:, None] + o_k[None, :] * V  # S^T [BV, BK] of the [K, V] state
        b_h = tl.load(h + p_s)
        b_dh = tl.load(dh + p_s)
        p_y, m_y = _tile(vb, t0, T, H * V, i_v * BV, BT, BV)
        b_dqg += tl.dot(tl.load(do + p_y, mask=m_y, other=0.0), b_h.to(do.dtype.element_ty), input_precision=PREC)
        b_dw -= tl.dot(tl.load(dU + p_y, mask=m_y, other=0.0).to(do.dtype.element_ty), b_h.to(do.dtype.element_ty),
                       input_precision=PREC)
        b_dkd += tl.dot(tl.load(U + p_y, mask=m_y, other=0.0), b_dh.to(U.dtype.element_ty), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
    p_x, m_x = _tile(kb, t0, T, H * K, i_k * BK, BT, BK)
    b_q = tl.load(q + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_G = tl.load(G + p_x, mask=m_x, other=0.0)
    last = tl.minimum(t0 + BT, T) - 1
    b_GL = tl.load(G + kb + last * H * K + o_k)  # [BK]
    b_eG = tl.exp(b_G)
    b_dq = scale * b_eG * b_dqg
    b_dG = b_dq * b_q
    b_dk = tl.exp(tl.where(m_t[:, None], b_GL[None, :] - b_G, 0.0)) * b_dkd
    b_dG -= b_dk * b_k
    b_dGL = tl.sum(b_dk * b_k, 0) + tl.exp(b_GL) * b_hdh  # [BK] grad of G_L
    # WY input x = beta k exp(G)
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    p_A, m_a = _tile(ab, t0, T, H * BT, 0, BT, BT)
    b_T = tl.load(Tinv + p_A, mask=m_a, other=0.0)
    b_dx = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)  # [BT, BK]
    b_ke = b_k * b_eG
    b_dk += b_b[:, None] * b_eG * b_dx
    b_dG += b_dx * b_ke * b_b[:, None]
    tl.atomic_add(dbeta + (i_b * T + t0 + o_i) * H + i_h, tl.sum(b_dx * b_ke, 1), mask=m_t)
    b_dT = tl.dot(b_dw, tl.trans(b_ke * b_b[:, None]), input_precision=PREC)  # [BT, BT]
    tl.atomic_add(dT + p_A, b_dT, mask=m_a)
    b_dG += tl.where((t0 + o_i)[:, None] == last, b_dGL[None, :], 0.0)
    tl.store(dq_p + p_x, b_dq, mask=m_x)
    tl.store(dk_p + p_x, b_dk, mask=m_x)
    tl.store(dG_p + p_x, b_dG, mask=m_x)


@triton.jit
def _bwd_dAkk_kernel(Tinv, dT, T, H: tl.constexpr, PREC: tl.constexpr):
    """dAkk = -Tinv^T dT Tinv^T (strictly lower), written over dT [B, T, H, BT] fp32, one chunk per program."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    m_t = (t0 + o_i) < T
    p_A = (i_b * T * H + i_h) * BT + (t0 + o_i)[:, None] * H * BT + o_i[None, :]
    b_T = tl.load(Tinv + p_A, mask=m_t[:, None], other=0.0)
    b_d = tl.dot(tl.load(dT + p_A, mask=m_t[:, None], other=0.0), tl.trans(b_T), input_precision=PREC)
    b_d = -tl.dot(tl.trans(b_T), b_d, input_precision=PREC)
    tl.store(dT + p_A, tl.where(o_i[None, :] < o_i[:, None], b_d, 0.0), mask=m_t[:, None])


# One program per (K-slice, 16-row sub-tile): BK 64 with 2 warps and 3 stages won on the H200 (NOTES.md).
PAIR_CONFIGS = [triton.Config({"BK": bk}, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4)
                for ns in (2, 3)]


@triton.autotune(configs=PAIR_CONFIGS, key=["H", "K"], restore_value=["dbeta", "dG"])
@triton.jit
def _bwd_pair_kernel(q, k, G, beta, dAkk, dAqk, dq_p, dk_p, dG, dq, dk, dbeta, scale, T, H: tl.constexpr,
                     K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """The pair terms of Aqk and Akk for one 16-row sub-tile i and one K-slice, as [16, 16] x [16, BK] products
    with fp32 operands (tf32 for 16-bit inputs: the gate gradient is a difference of nearly equal terms):
    rows side over the key blocks j <= i (dq, d(beta k) of the sub-tile's rows, reference = its first row),
    columns side over the row blocks j >= i (dk of its keys, reference = its last valid row). Adds the
    state-side partials and writes dq, dk and dG, the gate gradient before the chunk's reverse cumsum
    (in place over the state-side partial dG)."""
    i_kc, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_k, i_i = i_kc // NC, i_kc % NC
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    n = T - t0  # valid rows from the chunk's start
    r0 = i_i * BC  # the sub-tile's first row inside the chunk
    if r0 >= n:
        return
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    kb = (i_b * T * H + i_h) * K
    ab = (i_b * T * H + i_h) * BT
    p_c, m_c = _tile(kb, t0 + r0, T, H * K, i_k * BK, BC, BK)  # this sub-tile's rows  [BC, BK]
    b_Gc = tl.load(G + p_c, mask=m_c, other=0.0)
    b_Gr = tl.load(G + kb + (t0 + r0) * H * K + o_k)  # [BK]
    b_Gl = tl.load(G + kb + (t0 + tl.minimum(r0 + BC, n) - 1) * H * K + o_k)
    # rows side: keys of the blocks j <= i decayed to row r0 (exp(G_r0 - G_j) <= e^75 inside block i)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dbk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(0, i_i + 1):
        p_j, m_j = _tile(kb, t0 + i_j * BC, T, H * K, i_k * BK, BC, BK)
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_kj *= tl.exp(tl.where(m_j, b_Gr[None, :] - tl.load(G + p_j, mask=m_j, other=0.0), 0.0))
        p_a, _ = _tile(ab, t0 + r0, T, H * BT, i_j * BC, BC, BC)  # dA[rows of i, keys of j]  [BC, BC]
        b_dq += tl.dot(tl.load(dAqk + p_a, mask=m_c, other=0.0), b_kj, input_precision=PREC)
        b_dbk += tl.dot(tl.load(dAkk + p_a, mask=m_c, other=0.0), b_kj, input_precision=PREC)
    f_r = tl.exp(tl.where(m_c, b_Gc - b_Gr[None, :], 0.0))  # <= 1
    b_dq *= scale * f_r
    b_dbk *= f_r
    # columns side: rows of the blocks j >= i decayed to row l (exp(G_t - G_l) <= e^75 inside block i)
    b_dkc = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(i_i, tl.minimum(NC, tl.cdiv(n, BC))):
        r_j = t0 + i_j * BC
        p_j, m_j = _tile(kb, r_j, T, H * K, i_k * BK, BC, BK)
        f_j = tl.exp(tl.where(m_j, tl.load(G + p_j, mask=m_j, other=0.0) - b_Gl[None, :], 0.0))
        b_bj = tl.load(beta + (i_b * T + r_j + o_c) * H + i_h, mask=(r_j + o_c) < T, other=0.0).to(tl.float32)
        b_qj = tl.load(q + p_j, mask=m_j, other=0.0).to(tl.float32) * f_j * scale
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32) * f_j * b_bj[:, None]
        p_a, m_a = _tile(ab, r_j, T, H * BT, r0, BC, BC)  # dA[rows of j, keys of i]  [BC, BC]
        b_dkc += tl.dot(tl.trans(tl.load(dAqk + p_a, mask=m_a, other=0.0)), b_qj, input_precision=PREC)
        b_dkc += tl.dot(tl.trans(tl.load(dAkk + p_a, mask=m_a, other=0.0)), b_kj, input_precision=PREC)
    b_dkc *= tl.exp(tl.where(m_c, b_Gl[None, :] - b_Gc, 0.0))  # <= 1
    # the gate gradient (before the reverse cumsum), dbeta, and the state-side partials
    b_qc = tl.load(q + p_c, mask=m_c, other=0.0).to(tl.float32)
    b_kc = tl.load(k + p_c, mask=m_c, other=0.0).to(tl.float32)
    b_bc = tl.load(beta + (i_b * T + t0 + r0 + o_c) * H + i_h, mask=(r0 + o_c) < n, other=0.0).to(tl.float32)
    b_dG = b_dq * b_qc + (b_dbk * b_bc[:, None] - b_dkc) * b_kc + tl.load(dG + p_c, mask=m_c, other=0.0)
    tl.store(dG + p_c, b_dG, mask=m_c)
    tl.atomic_add(dbeta + (i_b * T + t0 + r0 + o_c) * H + i_h, tl.sum(b_dbk * b_kc, 1), mask=(r0 + o_c) < n)
    tl.store(dq + p_c, (b_dq + tl.load(dq_p + p_c, mask=m_c, other=0.0)).to(dq.dtype.element_ty), mask=m_c)
    b_dkc += b_dbk * b_bc[:, None] + tl.load(dk_p + p_c, mask=m_c, other=0.0)
    tl.store(dk + p_c, b_dkc.to(dk.dtype.element_ty), mask=m_c)


@triton.jit
def _bwd_gate_kernel(g, dG, dg, lower_bound, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                     GATE: tl.constexpr):
    """dg = reverse cumsum of dG over the chunk (times the gate's derivative lower_bound * s (1 - s) when GATE),
    one chunk and K-slice per program; the backward of _gate_cumsum_kernel."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    p_x, m_t = _tile((i_b * T * H + i_h) * K, i_t * BT, T, H * K, i_k * BK, BT, BK)
    b_dG = tl.load(dG + p_x, mask=m_t, other=0.0)  # [BT, BK]
    b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG
    if GATE:
        b_s = tl.sigmoid(tl.load(g + p_x, mask=m_t, other=0.0).to(tl.float32))
        b_dg *= lower_bound * b_s * (1.0 - b_s)
    tl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_t)


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _prec(x: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots (the reference tolerance). For 16-bit inputs, dots of 16-bit operands
    run as bf16/fp16 on the tensor cores and dots of fp32 operands (the pair products) as tf32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _forward(q, k, v, g, beta, scale, h0, store_ht, lower_bound, chunks):
    """All kernels see whole chunks: T is a multiple of CHUNK (the wrapper pads). ``chunks``: None, or
    (chunk_seq, chunk_flags, N) for a packed row of N chunk-aligned sequences."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // CHUNK
    N = B if chunks is None else chunks[2]
    chunk_seq, chunk_flags = (None, None) if chunks is None else chunks[:2]
    prec = _prec(q)
    f32 = dict(device=q.device, dtype=torch.float32)
    G = torch.empty(B, T, H, K, **f32)
    _gate_cumsum_kernel[(NT, B * H)](g, G, lower_bound or 0.0, T, H, K, GATE=lower_bound is not None)
    Aqk = torch.empty(B, T, H, CHUNK, **f32)
    Akk = torch.empty(B, T, H, CHUNK, **f32)
    _pair_matrices_kernel[(NT, B * H)](q, k, G, beta, Aqk, Akk, scale, T, H, K, PREC=prec, num_warps=4)
    Tinv = torch.empty(B, T, H, CHUNK, **f32)
    w, kd, qg = torch.empty_like(k), torch.empty_like(k), torch.empty_like(q)
    u = torch.empty_like(v)
    BV = min(64, V)
    _solve_wy_kernel[(NT, B * H)](q, k, v, G, beta, Akk, Tinv, w, u, kd, qg, scale, T, H, K, V, min(64, K), BV,
                                  PREC=prec, num_warps=4)
    del Akk
    h = torch.empty(B, NT, H, K, V, device=q.device, dtype=q.dtype)
    U = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if store_ht else None
    _state_fwd_kernel[lambda meta: (V // meta["BV"], B * H)](kd, G, w, u, h, U, h0, ht, chunk_seq, chunk_flags, T,
                                                             NT, H, K, V, HAS_H0=h0 is not None, STORE_HT=store_ht,
                                                             VARLEN=chunks is not None, PREC=prec)
    o = torch.empty_like(v)
    _output_kernel[(V // BV, NT, B * H)](qg, h, Aqk, U, o, T, NT, H, K, V, BV, PREC=prec, num_warps=4)
    return o, ht, (G, Aqk, Tinv, w, kd, qg, h, U)


def _backward(q, k, v, g, beta, scale, h0, lower_bound, chunks, saved, do, dht):
    G, Aqk, Tinv, w, kd, qg, h, U = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // CHUNK
    N = B if chunks is None else chunks[2]
    chunk_seq, chunk_flags = (None, None) if chunks is None else chunks[:2]
    prec = _prec(q)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dh = torch.empty_like(h)
    dU = torch.empty(B, T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    BV = min(64, V)
    _bwd_intra_dU_kernel[(V // BV, NT, B * H)](Aqk, do, dU, T, H, V, BV, PREC=prec, num_warps=4)
    _state_bwd_kernel[lambda meta: (V // meta["BV"], B * H)](qg, kd, G, w, do, dh, dU, dht, dh0, chunk_seq,
                                                             chunk_flags, T, NT, H, K, V, HAS_DHT=dht is not None,
                                                             STORE_DH0=h0 is not None, VARLEN=chunks is not None,
                                                             PREC=prec)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, H, CHUNK, **f32)
    dT = torch.empty(B, T, H, CHUNK, **f32)
    dbeta = torch.empty(B, T, H, **f32)
    _bwd_value_kernel[(NT, B * H)](v, beta, Tinv, U, dU, do, dv, dAqk, dT, dbeta, T, H, V, BV, PREC=prec,
                                   num_warps=4)
    BK = min(64, K)
    dq_p = torch.empty(B, T, H, K, **f32)
    dk_p = torch.empty(B, T, H, K, **f32)
    dG_p = torch.empty(B, T, H, K, **f32)
    _bwd_state_side_kernel[(K // BK, NT, B * H)](q, k, G, beta, Tinv, h, dh, U, dU, do, dq_p, dk_p, dG_p, dT,
                                                dbeta, scale, T, NT, H, K, V, BK, BV, PREC=prec, num_warps=4)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g)
    _bwd_dAkk_kernel[(NT, B * H)](Tinv, dT, T, H, PREC=prec, num_warps=4)  # dT becomes dAkk
    _bwd_pair_kernel[lambda meta: (K // meta["BK"] * (CHUNK // 16), NT, B * H)](
        q, k, G, beta, dT, dAqk, dq_p, dk_p, dG_p, dq, dk, dbeta, scale, T, H, K, PREC=prec)
    _bwd_gate_kernel[(K // BK, NT, B * H)](g, dG_p, dg, lower_bound or 0.0, T, H, K, BK,
                                           GATE=lower_bound is not None, num_warps=4)
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0


class ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """The kernels over whole chunks (T a multiple of CHUNK); ``chunks`` as in ``_forward``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, lower_bound, chunks):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.float().contiguous()
        o, ht, saved = _forward(q, k, v, g, beta, scale, h0, output_final_state, lower_bound, chunks)
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved)
        ctx.scale, ctx.lower_bound, ctx.chunks = scale, lower_bound, chunks
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, ctx.scale, h0, ctx.lower_bound, ctx.chunks, saved,
                                               do, None if dht is None else dht.float().contiguous())
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


@functools.lru_cache(maxsize=16)
def _packed_layout(bounds: tuple[int, ...], device: torch.device):
    """Chunk-aligned layout of a packed row with sequence bounds ``bounds`` (cu_seqlens): sequence i starts at
    a multiple of CHUNK. Returns (token -> padded position [T] int64, or None when every sequence is already
    aligned; padded length; chunk -> sequence [NT] int32; chunk flags [NT] int32 (FIRST | LAST))."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    chunks = [-(-n // CHUNK) for n in lengths]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c * CHUNK)
    dst = None
    if any(n % CHUNK for n in lengths[:-1]):  # an unaligned last sequence is only padded at the end
        dst = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(chunks))
    first = torch.tensor(starts[:-1]) // CHUNK
    flags = torch.zeros(len(seq), dtype=torch.int32)
    flags[first] |= FIRST.value
    flags[first + torch.tensor(chunks) - 1] |= LAST.value
    return dst, starts[-1], seq.to(device), flags.to(device)


def _place(x: torch.Tensor, dst: torch.Tensor | None, length: int, fill: float = 0.0) -> torch.Tensor:
    """x [B, T, ...] at positions ``dst`` (or the first T) of a ``fill``-ed [B, length, ...] (differentiable)."""
    if dst is None:
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, length - x.shape[1]), value=fill) if length > x.shape[1] else x
    return x.new_full((x.shape[0], length, *x.shape[2:]), fill).index_copy(1, dst, x)


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    gate_lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule on the GPU; differentiable in q, k, v, g, beta and initial_state.

    ``g`` is the per-channel log-decay (each entry >= ``G_MIN_SAFE``), or, with ``gate_lower_bound``
    set (e.g. -5), the raw gate logits: the kernel then computes ``g = gate_lower_bound * sigmoid(raw)``
    itself, fused with the chunk cumsum, and returns gradients w.r.t. the raw logits.
    ``cu_seqlens`` (int [N + 1], B = 1) packs N sequences of any lengths along T: each state starts from its
    row of ``initial_state`` [N, H, K, V] (or zero) and the final states have N rows.

    Any length works: the kernels only see whole chunks. A sequence is placed at a chunk boundary and padded
    to whole chunks with no-op tokens (k = v = q = 0, beta = 0, g = 0, which leave the state untouched), so a
    packed row costs at most CHUNK - 1 extra tokens per sequence and no copy at all when every sequence
    already fills whole chunks.
    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    for name, d in (("K", K), ("V", V)):
        # K = 32 gave non-finite bf16 gradients on the H200 (cause not found); 64, 128 and 256 are tested there
        if d < 64 or d > 256 or d & (d - 1):
            raise ValueError(f"head dim {name}={d} must be 64, 128 or 256")
    if gate_lower_bound is None:
        if bool((g < G_MIN_SAFE).any()):
            raise ValueError(f"log-decay below {G_MIN_SAFE}: this kernel needs the bounded gate "
                             "(use gate_lower_bound or the PyTorch chunked path for unbounded decay)")
    elif not G_MIN_SAFE <= gate_lower_bound < 0:
        raise ValueError(f"gate_lower_bound must be in [{G_MIN_SAFE}, 0), got {gate_lower_bound}")
    bounds = (0, T) if cu_seqlens is None else tuple(cu_seqlens.tolist())
    if cu_seqlens is not None and (B != 1 or bounds[0] != 0 or bounds[-1] != T
                                   or any(b <= a for a, b in zip(bounds[:-1], bounds[1:]))):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T = {T} with B = 1, got B = {B}, {list(bounds)}")
    rows = B if cu_seqlens is None else len(bounds) - 1
    if initial_state is not None and initial_state.shape != (rows, H, K, V):
        raise ValueError(f"initial_state must be {(rows, H, K, V)}, got {tuple(initial_state.shape)}")
    scale = K**-0.5 if scale is None else scale
    dst, length, chunk_seq, chunk_flags = _packed_layout(bounds, q.device)
    chunks = None if cu_seqlens is None else (chunk_seq, chunk_flags, rows)
    g_pad = 0.0 if gate_lower_bound is None else float("-inf")  # raw logits: lower_bound * sigmoid(-inf) = 0
    q, k, v, beta = (_place(x, dst, length) for x in (q, k, v, beta))
    o, ht = ChunkGatedDeltaRuleTriton.apply(q, k, v, _place(g, dst, length, g_pad), beta, scale, initial_state,
                                            output_final_state, gate_lower_bound, chunks)
    return (o[:, :T] if dst is None else o.index_select(1, dst)), ht


# ----------------------------------------------------------------------------------------------------
# decode: one token, fused
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _decode_step_kernel(q, k, v, g, beta, state, o, new_state, scale, H: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr):
    """S = diag(exp(g)) S; S += beta k (v - S^T k)^T; o = S^T (scale q) for one (batch, head, V-slice)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + i_bh * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k).to(tl.float32)
    b_g = tl.load(g + i_bh * K + o_k).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v).to(tl.float32)
    b_b = tl.load(beta + i_bh).to(tl.float32)
    p_s = i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(state + p_s) * tl.exp(b_g)[:, None]  # [K, BV]
    b_delta = (b_v - tl.sum(b_k[:, None] * b_s, 0)) * b_b
    b_s += b_k[:, None] * b_delta[None, :]
    tl.store(o + i_bh * V + o_v, tl.sum((b_q * scale)[:, None] * b_s, 0))
    tl.store(new_state + p_s, b_s)


def gated_delta_rule_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused decode step, same contract as ``kernels.gated_delta.gated_delta_rule_step``:
    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] fp32 -> (o [B, H, V] fp32, new state).
    ``inplace`` overwrites ``state`` (the decode loop's usual mode)."""
    B, H, K = q.shape
    V = v.shape[-1]
    if state.dtype != torch.float32 or state.shape != (B, H, K, V) or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [B, H, K, V] = {(B, H, K, V)}, got "
                         f"{state.dtype} {tuple(state.shape)}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    scale = K**-0.5 if scale is None else scale
    o = torch.empty(B, H, V, device=q.device, dtype=torch.float32)
    new_state = state if inplace else torch.empty_like(state)
    BV = min(32, V)
    _decode_step_kernel[(V // BV, B * H)](q, k, v, g, beta, state, o, new_state, scale, H, K, V, BV)
    return o, new_state
