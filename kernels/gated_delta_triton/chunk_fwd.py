"""Forward kernels of the chunked gated delta rule: gate + cumsum -> pair matrices -> blocked triangular inverse
+ WY -> sequential state pass -> output (the algorithm is in the package docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_triton.common import (BC, BT, MIN_STEPS, _chunk_rows, _diagonal_inverses16, _load16, _mm,
                                               _sequence, _state_step, _store16, _tile)


@triton.jit
def _gate_cumsum_kernel(g, G, lower_bound, T, chunk_rows, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr,
                        VARLEN: tl.constexpr):
    """G[chunk] = cumsum over the chunk of g (or of lower_bound * sigmoid(g) when GATE). [BT, K] fp32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    kb = (i_b * T * H + i_h) * K
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    p_x, m_t = _tile(kb, t0, t1, H * K, 0, BT, K)
    b_g = tl.load(g + p_x, mask=m_t, other=0.0).to(tl.float32)  # [BT, K]
    if GATE:
        b_g = tl.where(m_t, lower_bound * tl.sigmoid(b_g), 0.0)
    tl.store(G + p_x, tl.cumsum(b_g, axis=0), mask=m_t)


@triton.jit
def _pair_matrices_kernel(q, k, G, beta, Aqk, Akk, scale, T, chunk_rows, H: tl.constexpr, K: tl.constexpr,
                          PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Rows of one 16-row sub-tile i of Aqk [BT, BT] (incl. diagonal, times scale; in q's dtype, as the output and
    dU kernels take it) and Akk [BT, BT] (strictly lower, times beta_i; fp32), as [16, K] x [K, 16] products over
    the key blocks j <= i (Aqk's blocks above are zero; Akk's are left unwritten: the solve reads only the
    blocks at and below the diagonal, and Akk dies there), with reference row r = the sub-tile's first row:
    exp(G_t - G_r) <= 1 for its rows, exp(G_r - G_j) <= 1 for keys before it and <= e^75 inside it. fp32 operands
    (tf32 on the tensor cores for 16-bit inputs). One program per sub-tile, as the pair gradients
    (_bwd_pair_kernel) are organised."""
    i_i, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    r0 = i_i * BC  # the sub-tile's first row inside the chunk
    kb = (i_b * T * H + i_h) * K
    ab = (i_b * T * H + i_h) * BT
    if t0 + r0 >= t1:
        return
    o_c = tl.arange(0, BC)
    p_a, m_a = _tile(ab, t0 + r0, t1, H * BT, 0, BC, BC)  # block (i, 0) of the [BT, BT] rows  [BC, BC]
    b_Gr = tl.load(G + kb + (t0 + r0) * H * K + tl.arange(0, K))  # [K]
    p_c, m_c = _tile(kb, t0 + r0, t1, H * K, 0, BC, K)
    f_c = tl.exp(tl.where(m_c, tl.load(G + p_c, mask=m_c, other=0.0) - b_Gr[None, :], 0.0))  # <= 1
    b_qc = tl.load(q + p_c, mask=m_c, other=0.0).to(tl.float32) * f_c  # [BC, K]
    b_kc = tl.load(k + p_c, mask=m_c, other=0.0).to(tl.float32) * f_c
    b_b = tl.load(beta + (i_b * T + t0 + r0 + o_c) * H + i_h, mask=(t0 + r0 + o_c) < t1, other=0.0).to(tl.float32)
    for i_j in range(0, i_i + 1):
        p_j, m_j = _tile(kb, t0 + i_j * BC, t1, H * K, 0, BC, K)
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_kj *= tl.exp(tl.where(m_j, b_Gr[None, :] - tl.load(G + p_j, mask=m_j, other=0.0), 0.0))
        b_aqk = tl.dot(b_qc, tl.trans(b_kj), input_precision=PREC) * scale  # [BC, BC]
        b_akk = tl.dot(b_kc, tl.trans(b_kj), input_precision=PREC) * b_b[:, None]
        m_d = (o_c[:, None] > o_c[None, :]) | (i_j < i_i)  # below the diagonal
        b_aqk = tl.where(m_d | (o_c[:, None] == o_c[None, :]), b_aqk, 0.0)
        tl.store(Aqk + p_a + i_j * BC, b_aqk.to(Aqk.dtype.element_ty), mask=m_a)
        tl.store(Akk + p_a + i_j * BC, tl.where(m_d, b_akk, 0.0), mask=m_a)
    b_0 = tl.zeros([BC, BC], dtype=Aqk.dtype.element_ty)
    for i_j in range(i_i + 1, BT // BC):  # Aqk's blocks above the diagonal (Akk's are never read)
        tl.store(Aqk + p_a + i_j * BC, b_0, mask=m_a)


@triton.jit
def _solve_wy_kernel(q, k, v, G, beta, Akk, Tinv, w, u, kd, qg, scale, T, chunk_rows, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                     VARLEN: tl.constexpr):
    """Tinv = (I + Akk)^-1 by blocks: four 16x16 diagonal inverses (forward substitution), the six blocks
    below them by exact fp32 matmuls (X_ij = -X_ii sum_{j<=m<i} A_im X_mj). Then, for the later kernels,
    w = Tinv (beta k exp(G)) [BT, K], u = Tinv (beta v) [BT, V], kd = k exp(G_L - G) and qg = scale q exp(G)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    n = t1 - t0  # valid rows in this chunk
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
    last = n - 1
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


# The two sequential kernels run one (sequence, head, V-slice) per program, chunk after chunk: the slice width
# trades programs (SMs in use) against work per step, and a third pipeline stage loads the next chunk's
# operands earlier (-0.8 ms of 15.8 at 64K tokens, benchmarks/kernels/NOTES.md; BV = 64 with 3 stages needs
# 256 KiB of shared memory in fp32). 4 warps: with 2 the state kernels spill heavily (and one such config
# crashed on the H200).
# With fp32 operands and a head dim over 128 no pipelined config of the backward state kernel fits in shared memory:
# the next chunk's [64, 256] fp32 operands are copied in while the current ones are used (237,568 B at the smallest
# in 3xTF32, 425,984 B in TF32, whose dots stage their operands in shared memory; the H200's limit is 232,448;
# benchmarks/kernels/resources.py). Unpipelined (num_stages 1) they fit (BV 16, 32 in 3xTF32, BV 16 in TF32):
# such shapes get only the unpipelined configs, every other shape only the pipelined ones (_state_configs).
STATE_CONFIGS = [triton.Config({"BV": bv}, num_warps=4, num_stages=ns) for bv, ns in ((16, 2), (32, 2), (64, 2),
                                                                                    (16, 3), (32, 3), (16, 1),
                                                                                    (32, 1), (64, 1))]


def _state_configs(configs, named_args, **kwargs):
    """The autotuner's early prune of STATE_CONFIGS: unpipelined configs exactly where pipelined ones do not fit."""
    wide = named_args["kd"].dtype == torch.float32 and max(named_args["K"], named_args["V"]) > 128
    return [c for c in configs if (c.num_stages == 1) == wide]


@triton.autotune(configs=STATE_CONFIGS, key=["H", "K", "V", "PREC"],
                 prune_configs_by={"early_config_prune": _state_configs})
@triton.jit
def _state_fwd_kernel(kd, G, w, u, h, U, h0, ht, seqs, T, NT, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                      VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Sequential pass over one sequence's chunks for one (sequence, head, V-slice): stores the chunk-start
    states h [B, NT, H, K, V] and U = u - w S [B, T, H, V]; S' = exp(G_L) S + kd^T U. Only the state is
    carried between steps; every other operand was prepared by the parallel kernels. The sequences of a packed
    row (VARLEN) run in parallel, each from its h0 row (or zero) to its ht row."""
    i_v, i_h, i_b, p_n, bos, eos, c0, nc = _sequence(T, NT, seqs, H, K, V, BV, VARLEN)
    o_k = tl.arange(0, K)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    o_s, _ = _tile(0, 0, K, V, i_v * BV, K, BV)  # this V-slice of one [K, V] state
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        b_h = tl.load(h0 + p_n + o_s)
    for i_s in range(tl.maximum(nc, MIN_STEPS)):
        live, j, t0, t1 = _state_step(i_s, bos, eos, nc, REVERSE=False)
        tl.store(h + ((i_b * NT + c0 + j) * H + i_h).to(tl.int64) * K * V + o_s, b_h.to(h.dtype.element_ty),
                 mask=live)
        p_x, m_t = _tile(kb, t0, t1, H * K, 0, BT, K)
        p_y, m_y = _tile(vb, t0, t1, H * V, i_v * BV, BT, BV)
        b_w = tl.load(w + p_x, mask=m_t, other=0.0)  # [BT, K]
        b_kd = tl.load(kd + p_x, mask=m_t, other=0.0)
        b_GL = tl.load(G + kb + (t1 - 1) * H * K + o_k)  # [K]
        b_U = tl.load(u + p_y, mask=m_y, other=0.0).to(tl.float32)
        b_U -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)  # [BT, BV]
        tl.store(U + p_y, b_U.to(U.dtype.element_ty), mask=m_y & live)
        b_h = tl.where(live, b_h * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_kd), b_U.to(b_kd.dtype),
                                                                   input_precision=PREC), b_h)
    if STORE_HT:
        tl.store(ht + p_n + o_s, b_h)


@triton.jit
def _output_kernel(qg, h, Aqk, U, o, T, NT, chunk_rows, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """o = qg S + Aqk U   (qg = scale q exp(G)) for one chunk and one V-slice."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    p_q, m_t = _tile(qg + (i_b * T * H + i_h) * K, t0, t1, H * K, 0, BT, K)
    p_h, _ = _tile(h + ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V, 0, K, V, i_v * BV, K, BV)
    b_o = tl.dot(tl.load(p_q, mask=m_t, other=0.0), tl.load(p_h).to(qg.dtype.element_ty), input_precision=PREC)
    p_A, _ = _tile(Aqk + (i_b * T * H + i_h) * BT, t0, t1, H * BT, 0, BT, BT)
    p_U, _ = _tile((i_b * T * H + i_h) * V, t0, t1, H * V, i_v * BV, BT, BV)
    b_o += tl.dot(tl.load(p_A, mask=m_t, other=0.0).to(U.dtype.element_ty), tl.load(U + p_U, mask=m_t, other=0.0),
                  input_precision=PREC)
    tl.store(o + p_U, b_o.to(o.dtype.element_ty), mask=m_t)
