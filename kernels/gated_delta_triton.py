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

Forward kernels: gate + cumsum -> pair matrices -> triangular solve + WY -> sequential state pass ->
output. Backward: sequential reverse state pass -> value-side grads -> state-side grads ->
pair-matrix grads + reverse cumsum. Intermediates are kept from the forward (no recompute).

Shapes (as in ``kernels/gated_delta.py``): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V] fp32. K and V must be 64, 128 or 256 (64 and 128 tested on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # chunk length
BT = tl.constexpr(CHUNK)  # the same, as the kernels see it
BC = tl.constexpr(16)  # sub-tile length: one reference row per 16 tokens keeps exp() finite
G_MIN_SAFE = -5.5  # 15 steps * 5.5 = 82.5 < log(fp32 max) ~ 88.7


# ----------------------------------------------------------------------------------------------------
# forward kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _gate_cumsum_kernel(g, G, lower_bound, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                        GATE: tl.constexpr):
    """G[chunk] = cumsum over the chunk of g (or of lower_bound * sigmoid(g) when GATE). [BT, K] fp32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    base = (i_b * T * H + i_h) * K
    p_g = tl.make_block_ptr(g + base, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)  # [BT, BK]
    if GATE:
        m_t = (i_t * BT + tl.arange(0, BT)) < T
        b_g = tl.where(m_t[:, None], lower_bound * tl.sigmoid(b_g), 0.0)
    b_G = tl.cumsum(b_g, axis=0)
    p_G = tl.make_block_ptr(G + base, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    tl.store(p_G, b_G, boundary_check=(0, 1))


@triton.jit
def _pair_matrices_kernel(q, k, G, beta, Aqk, Akk, scale, T, H: tl.constexpr, K: tl.constexpr,
                          BK: tl.constexpr, PREC: tl.constexpr):
    """Aqk [BT, BT] (incl. diagonal, times scale) and Akk [BT, BT] (strictly lower, times beta_i), one
    16-row sub-tile at a time with reference row r = first row of the sub-tile."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    base = (i_b * T * H + i_h) * K
    o_j = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    p_k = tl.make_block_ptr(k + base, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
    p_G = tl.make_block_ptr(G + base, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)  # [BT, BK] all keys of the chunk
    b_G = tl.load(p_G, boundary_check=(0, 1))
    m_j = (t0 + o_j) < T
    for i_c in tl.static_range(BT // BC):
        r0 = i_c * BC
        if t0 + r0 < T:
            b_Gr = tl.load(G + base + (t0 + r0) * H * K + o_k, mask=o_k < K, other=0.0)  # [BK]
            p_qc = tl.make_block_ptr(q + base, (T, K), (H * K, 1), (t0 + r0, 0), (BC, BK), (1, 0))
            p_kc = tl.make_block_ptr(k + base, (T, K), (H * K, 1), (t0 + r0, 0), (BC, BK), (1, 0))
            p_Gc = tl.make_block_ptr(G + base, (T, K), (H * K, 1), (t0 + r0, 0), (BC, BK), (1, 0))
            b_Gc = tl.load(p_Gc, boundary_check=(0, 1))  # [BC, BK]
            m_c = (t0 + r0 + tl.arange(0, BC)) < T
            f_c = tl.exp(tl.where(m_c[:, None], b_Gc - b_Gr[None, :], 0.0))  # <= 1
            b_qc = tl.load(p_qc, boundary_check=(0, 1)).to(tl.float32) * f_c
            b_kc = tl.load(p_kc, boundary_check=(0, 1)).to(tl.float32) * f_c
            # keys j < r0 + BC, decayed to the reference row; later keys are masked (they would overflow)
            m_col = m_j & (o_j < r0 + BC)
            b_kj = tl.where(m_col[:, None], b_k * tl.exp(tl.where(m_col[:, None], b_Gr[None, :] - b_G, 0.0)), 0.0)
            b_kj = b_kj.to(k.dtype.element_ty)
            b_aqk = tl.dot(b_qc.to(k.dtype.element_ty), tl.trans(b_kj), input_precision=PREC)  # [BC, BT]
            b_akk = tl.dot(b_kc.to(k.dtype.element_ty), tl.trans(b_kj), input_precision=PREC)
            o_i = r0 + tl.arange(0, BC)
            b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_c, other=0.0).to(tl.float32)
            b_aqk = tl.where(o_j[None, :] <= o_i[:, None], b_aqk * scale, 0.0)
            b_akk = tl.where(o_j[None, :] < o_i[:, None], b_akk * b_b[:, None], 0.0)
            p_aqk = tl.make_block_ptr(Aqk + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0 + r0, 0), (BC, BT), (1, 0))
            p_akk = tl.make_block_ptr(Akk + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0 + r0, 0), (BC, BT), (1, 0))
            tl.store(p_aqk, b_aqk, boundary_check=(0, 1))
            tl.store(p_akk, b_akk, boundary_check=(0, 1))


@triton.jit
def _solve_wy_kernel(k, v, G, beta, Akk, Tinv, w, u, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Tinv = (I + Akk)^-1 by forward substitution (fp32); w = Tinv (beta k exp(G)) [BT, K];
    u = Tinv (beta v) [BT, V]."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    m_t = (t0 + o_i) < T
    p_A = tl.make_block_ptr(Akk + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    b_A = tl.load(p_A, boundary_check=(0, 1))  # [BT, BT] strictly lower
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(o_i[:, None] == i, b_A, 0.0), 0)  # row i of Akk  [BT]
        t_i = tl.sum(a_i[:, None] * b_T, 0)  # sum_j A[i, j] T[j, :]  (rows j < i are final)
        b_T = tl.where(o_i[:, None] == i, b_T - t_i[None, :], b_T)
    p_T = tl.make_block_ptr(Tinv + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    tl.store(p_T, b_T, boundary_check=(0, 1))
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_Tc = b_T.to(k.dtype.element_ty)
    kb = (i_b * T * H + i_h) * K
    p_k = tl.make_block_ptr(k + kb, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
    p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
    b_x = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * tl.exp(tl.load(p_G, boundary_check=(0, 1)))
    b_x = (b_x * b_b[:, None]).to(k.dtype.element_ty)
    b_w = tl.dot(b_Tc, b_x, input_precision=PREC)  # [BT, BK]
    p_w = tl.make_block_ptr(w + kb, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
    tl.store(p_w, b_w.to(w.dtype.element_ty), boundary_check=(0, 1))
    vb = (i_b * T * H + i_h) * V
    for i_v in tl.static_range(V // BV):
        p_v = tl.make_block_ptr(v + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_v = (tl.load(p_v, boundary_check=(0, 1)).to(tl.float32) * b_b[:, None]).to(v.dtype.element_ty)
        b_u = tl.dot(b_Tc, b_v, input_precision=PREC)  # [BT, BV]
        p_u = tl.make_block_ptr(u + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_u, b_u.to(u.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _state_fwd_kernel(k, G, w, u, h, U, h0, ht, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Sequential pass over chunks for one (batch, head, V-slice): stores the chunk-start states
    h [B, NT, H, K, V] and U = u - w S [B, T, H, V]."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = tl.make_block_ptr(h0 + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        b_h = tl.load(p_h0).to(tl.float32)
    for i_t in range(NT):
        t0 = i_t * BT
        p_h = tl.make_block_ptr(h + ((i_b * NT + i_t) * H + i_h) * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        tl.store(p_h, b_h.to(h.dtype.element_ty))
        p_w = tl.make_block_ptr(w + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        p_u = tl.make_block_ptr(u + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_U = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32)
        b_U -= tl.dot(tl.load(p_w, boundary_check=(0, 1)), b_h.to(w.dtype.element_ty), input_precision=PREC)
        p_U = tl.make_block_ptr(U + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_U, b_U.to(U.dtype.element_ty), boundary_check=(0, 1))
        last = tl.minimum(t0 + BT, T) - 1
        b_GL = tl.load(G + kb + last * H * K + o_k)  # [K]
        p_k = tl.make_block_ptr(k + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        m_t = (t0 + o_t) < T
        b_kd = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * tl.exp(
            tl.where(m_t[:, None], b_GL[None, :] - tl.load(p_G, boundary_check=(0, 1)), 0.0))  # [BT, K]
        b_h = b_h * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_kd.to(k.dtype.element_ty)), b_U.to(k.dtype.element_ty),
                                                     input_precision=PREC)
    if STORE_HT:
        p_ht = tl.make_block_ptr(ht + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        tl.store(p_ht, b_h)


@triton.jit
def _output_kernel(q, G, h, Aqk, U, o, scale, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr):
    """o = scale (q exp(G)) S + Aqk U   for one chunk and one V-slice."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    p_q = tl.make_block_ptr(q + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
    p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
    b_qg = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32) * tl.exp(tl.load(p_G, boundary_check=(0, 1))) * scale
    p_h = tl.make_block_ptr(h + ((i_b * NT + i_t) * H + i_h) * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
    b_o = tl.dot(b_qg.to(q.dtype.element_ty), tl.load(p_h).to(q.dtype.element_ty), input_precision=PREC)
    p_A = tl.make_block_ptr(Aqk + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    p_U = tl.make_block_ptr(U + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
    b_o += tl.dot(tl.load(p_A, boundary_check=(0, 1)).to(U.dtype.element_ty), tl.load(p_U, boundary_check=(0, 1)),
                  input_precision=PREC)
    p_o = tl.make_block_ptr(o + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
    tl.store(p_o, b_o.to(o.dtype.element_ty), boundary_check=(0, 1))


# ----------------------------------------------------------------------------------------------------
# backward kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _state_bwd_kernel(q, k, G, w, Aqk, do, dh, dU, dht, dh0, scale, T, NT, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                      PREC: tl.constexpr):
    """Reverse sequential pass. dh[n] = dL/d(state at the end of chunk n) [B, NT, H, K, V];
    dU = Aqk^T dO + Kd dS' [B, T, H, V];  dS = exp(G_L) dS' + Qg^T dO - w^T dU."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_DHT:
        p_dht = tl.make_block_ptr(dht + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        b_dh = tl.load(p_dht).to(tl.float32)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        t0 = i_t * BT
        p_dh = tl.make_block_ptr(dh + ((i_b * NT + i_t) * H + i_h) * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        tl.store(p_dh, b_dh.to(dh.dtype.element_ty))
        m_t = (t0 + o_t) < T
        last = tl.minimum(t0 + BT, T) - 1
        b_GL = tl.load(G + kb + last * H * K + o_k)  # [K]
        p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        b_G = tl.load(p_G, boundary_check=(0, 1))
        p_k = tl.make_block_ptr(k + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        b_kd = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * tl.exp(tl.where(m_t[:, None], b_GL[None, :] - b_G, 0.0))
        p_A = tl.make_block_ptr(Aqk + (i_b * T * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
        p_do = tl.make_block_ptr(do + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1))
        b_dU = tl.dot(tl.trans(tl.load(p_A, boundary_check=(0, 1)).to(do.dtype.element_ty)), b_do, input_precision=PREC)
        b_dU += tl.dot(b_kd.to(k.dtype.element_ty), b_dh.to(k.dtype.element_ty), input_precision=PREC)  # [BT, BV]
        p_dU = tl.make_block_ptr(dU + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_dU, b_dU.to(dU.dtype.element_ty), boundary_check=(0, 1))
        p_q = tl.make_block_ptr(q + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        b_qg = (tl.load(p_q, boundary_check=(0, 1)).to(tl.float32) * tl.exp(b_G) * scale).to(q.dtype.element_ty)
        p_w = tl.make_block_ptr(w + kb, (T, K), (H * K, 1), (t0, 0), (BT, K), (1, 0))
        b_dh = b_dh * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(q.dtype.element_ty), input_precision=PREC)
        b_dh -= tl.dot(tl.trans(tl.load(p_w, boundary_check=(0, 1))), b_dU.to(w.dtype.element_ty), input_precision=PREC)
    if STORE_DH0:
        p_dh0 = tl.make_block_ptr(dh0 + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
        tl.store(p_dh0, b_dh)


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
    p_T = tl.make_block_ptr(Tinv + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    b_Tt = tl.trans(tl.load(p_T, boundary_check=(0, 1))).to(v.dtype.element_ty)  # Tinv^T
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in tl.static_range(V // BV):
        p_v = tl.make_block_ptr(v + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_U = tl.make_block_ptr(U + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_dU = tl.make_block_ptr(dU + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_dU = tl.load(p_dU, boundary_check=(0, 1))
        b_dA += tl.dot(tl.load(p_do, boundary_check=(0, 1)), tl.trans(tl.load(p_U, boundary_check=(0, 1))),
                       input_precision=PREC)
        b_bv = (b_v.to(tl.float32) * b_b[:, None]).to(v.dtype.element_ty)
        b_dT += tl.dot(b_dU, tl.trans(b_bv), input_precision=PREC)
        b_du = tl.dot(b_Tt, b_dU, input_precision=PREC)  # [BT, BV] grad of beta v
        b_db += tl.sum(b_du * b_v.to(tl.float32), 1)
        p_dv = tl.make_block_ptr(dv + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_dv, (b_du * b_b[:, None]).to(dv.dtype.element_ty), boundary_check=(0, 1))
    b_dA = tl.where(o_i[None, :] <= o_i[:, None], b_dA, 0.0)
    p_dA = tl.make_block_ptr(dAqk + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    tl.store(p_dA, b_dA, boundary_check=(0, 1))
    p_dT = tl.make_block_ptr(dT + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    tl.store(p_dT, b_dT, boundary_check=(0, 1))
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
    hb = ((i_b * NT + i_t) * H + i_h) * K * V
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in tl.static_range(V // BV):
        p_h = tl.make_block_ptr(h + hb, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))  # S^T
        p_dh = tl.make_block_ptr(dh + hb, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
        p_U = tl.make_block_ptr(U + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_dU = tl.make_block_ptr(dU + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do + vb, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_h = tl.load(p_h)  # [BV, BK]
        b_dh = tl.load(p_dh)
        b_dqg += tl.dot(tl.load(p_do, boundary_check=(0, 1)), b_h.to(do.dtype.element_ty), input_precision=PREC)
        b_dw -= tl.dot(tl.load(p_dU, boundary_check=(0, 1)), b_h.to(dU.dtype.element_ty), input_precision=PREC)
        b_dkd += tl.dot(tl.load(p_U, boundary_check=(0, 1)), b_dh.to(U.dtype.element_ty), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
    p_q = tl.make_block_ptr(q + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32)
    b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
    b_G = tl.load(p_G, boundary_check=(0, 1))
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
    p_T = tl.make_block_ptr(Tinv + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    b_T = tl.load(p_T, boundary_check=(0, 1))
    b_dx = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)  # [BT, BK]
    b_ke = b_k * b_eG
    b_dk += b_b[:, None] * b_eG * b_dx
    b_dG += b_dx * b_ke * b_b[:, None]
    tl.atomic_add(dbeta + (i_b * T + t0 + o_i) * H + i_h, tl.sum(b_dx * b_ke, 1), mask=m_t)
    b_dT = tl.dot(b_dw, tl.trans(b_ke * b_b[:, None]), input_precision=PREC)  # [BT, BT]
    p_dT = dT + ab + (t0 + o_i)[:, None] * H * BT + o_i[None, :]
    tl.atomic_add(p_dT, b_dT, mask=m_t[:, None])
    b_dG += tl.where((t0 + o_i)[:, None] == last, b_dGL[None, :], 0.0)
    p_dq = tl.make_block_ptr(dq_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dG = tl.make_block_ptr(dG_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    tl.store(p_dq, b_dq, boundary_check=(0, 1))
    tl.store(p_dk, b_dk, boundary_check=(0, 1))
    tl.store(p_dG, b_dG, boundary_check=(0, 1))


@triton.jit
def _bwd_pair_kernel(q, k, g, G, beta, Tinv, dT, dAqk, dq_p, dk_p, dG_p, dq, dk, dg, dbeta, scale, lower_bound,
                     T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                     PREC: tl.constexpr):
    """Per chunk and K-slice: dAkk = -Tinv^T dT Tinv^T, then the pair terms of Aqk and Akk through one
    reference row per 16-token sub-tile (rows side and columns side), then dg = reverse cumsum of dG."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = (t0 + o_i) < T
    kb = (i_b * T * H + i_h) * K
    ab = (i_b * T * H + i_h) * BT
    last = tl.minimum(t0 + BT, T) - 1 - t0  # last valid row inside the chunk
    p_T = tl.make_block_ptr(Tinv + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    p_dT = tl.make_block_ptr(dT + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    p_dA = tl.make_block_ptr(dAqk + ab, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    b_T = tl.load(p_T, boundary_check=(0, 1))
    b_dAkk = tl.dot(tl.load(p_dT, boundary_check=(0, 1)), tl.trans(b_T), input_precision=PREC)
    b_dAkk = -tl.dot(tl.trans(b_T), b_dAkk, input_precision=PREC)
    b_dAkk = tl.where(o_i[None, :] < o_i[:, None], b_dAkk, 0.0).to(k.dtype.element_ty)  # [BT, BT]
    b_dAqk = tl.load(p_dA, boundary_check=(0, 1)).to(k.dtype.element_ty)
    p_q = tl.make_block_ptr(q + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_G = tl.make_block_ptr(G + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32)
    b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
    b_G = tl.load(p_G, boundary_check=(0, 1))
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_bk = b_b[:, None] * b_k
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dG = tl.zeros([BT, BK], dtype=tl.float32)
    b_dbk = tl.zeros([BT, BK], dtype=tl.float32)  # grad of (beta_i k_i) from Akk's row side
    for i_c in tl.static_range(BT // BC):
        r0 = i_c * BC
        if r0 <= last:
            m_c = (o_i >= r0) & (o_i < r0 + BC) & m_t  # rows of this sub-tile
            # rows side, reference = first row of the sub-tile
            b_Gr = tl.load(G + kb + (t0 + r0) * H * K + o_k)
            m_j = (o_i < r0 + BC) & m_t
            b_kj = tl.where(m_j[:, None], b_k * tl.exp(tl.where(m_j[:, None], b_Gr[None, :] - b_G, 0.0)), 0.0)
            b_kj = b_kj.to(k.dtype.element_ty)
            f_r = tl.exp(tl.where(m_c[:, None], b_G - b_Gr[None, :], 0.0))
            b_rq = tl.dot(b_dAqk, b_kj, input_precision=PREC)  # [BT, BK]
            b_rk = tl.dot(b_dAkk, b_kj, input_precision=PREC)
            b_dq += tl.where(m_c[:, None], f_r * b_rq, 0.0)
            b_dbk += tl.where(m_c[:, None], f_r * b_rk, 0.0)
            # columns side, reference = last valid row of the sub-tile
            rl = tl.minimum(r0 + BC - 1, last)
            b_Gl = tl.load(G + kb + (t0 + rl) * H * K + o_k)
            m_r = (o_i >= r0) & m_t
            f_l = tl.exp(tl.where(m_r[:, None], b_G - b_Gl[None, :], 0.0))
            b_qr = tl.where(m_r[:, None], b_q * f_l, 0.0).to(k.dtype.element_ty)
            b_kr = tl.where(m_r[:, None], b_bk * f_l, 0.0).to(k.dtype.element_ty)
            b_c = scale * tl.dot(tl.trans(b_dAqk), b_qr, input_precision=PREC)
            b_c += tl.dot(tl.trans(b_dAkk), b_kr, input_precision=PREC)  # [BT, BK]
            f_c = tl.exp(tl.where(m_c[:, None], b_Gl[None, :] - b_G, 0.0))
            b_dkc = tl.where(m_c[:, None], f_c * b_c, 0.0)
            b_dk += b_dkc
            b_dG -= b_dkc * b_k
    b_dq = b_dq * scale
    b_dG += b_dq * b_q + b_dbk * b_bk
    b_dk += b_dbk * b_b[:, None]
    tl.atomic_add(dbeta + (i_b * T + t0 + o_i) * H + i_h, tl.sum(b_dbk * b_k, 1), mask=m_t)
    p_dqp = tl.make_block_ptr(dq_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dkp = tl.make_block_ptr(dk_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dGp = tl.make_block_ptr(dG_p + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    b_dq += tl.load(p_dqp, boundary_check=(0, 1))
    b_dk += tl.load(p_dkp, boundary_check=(0, 1))
    b_dG += tl.load(p_dGp, boundary_check=(0, 1))
    b_dG = tl.where(m_t[:, None], b_dG, 0.0)
    b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG  # reverse cumsum within the chunk
    if GATE:
        p_g = tl.make_block_ptr(g + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        b_s = tl.sigmoid(tl.load(p_g, boundary_check=(0, 1)).to(tl.float32))
        b_dg = b_dg * lower_bound * b_s * (1.0 - b_s)
    p_dq = tl.make_block_ptr(dq + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    p_dg = tl.make_block_ptr(dg + kb, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
    tl.store(p_dq, b_dq.to(dq.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dk, b_dk.to(dk.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dg, b_dg.to(dg.dtype.element_ty), boundary_check=(0, 1))


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _prec(x: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots (the reference tolerance); bf16/fp16 run on the tensor cores."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _forward(q, k, v, g, beta, scale, h0, store_ht, lower_bound):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    prec = _prec(q)
    f32 = dict(device=q.device, dtype=torch.float32)
    G = torch.empty(B, T, H, K, **f32)
    _gate_cumsum_kernel[(NT, B * H)](g, G, lower_bound or 0.0, T, H, K, K, GATE=lower_bound is not None)
    Aqk = torch.empty(B, T, H, CHUNK, **f32)
    Akk = torch.empty(B, T, H, CHUNK, **f32)
    _pair_matrices_kernel[(NT, B * H)](q, k, G, beta, Aqk, Akk, scale, T, H, K, K, PREC=prec, num_warps=4)
    Tinv = torch.empty(B, T, H, CHUNK, **f32)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    BV = min(64, V)
    _solve_wy_kernel[(NT, B * H)](k, v, G, beta, Akk, Tinv, w, u, T, H, K, V, K, BV, PREC=prec, num_warps=4)
    del Akk
    h = torch.empty(B, NT, H, K, V, device=q.device, dtype=q.dtype)
    U = torch.empty_like(v)
    ht = torch.empty(B, H, K, V, **f32) if store_ht else None
    BVs = min(32, V)
    _state_fwd_kernel[(V // BVs, B * H)](k, G, w, u, h, U, h0, ht, T, NT, H, K, V, BVs, HAS_H0=h0 is not None,
                                         STORE_HT=store_ht, PREC=prec, num_warps=4, num_stages=2)
    o = torch.empty_like(v)
    _output_kernel[(V // BV, NT, B * H)](q, G, h, Aqk, U, o, scale, T, NT, H, K, V, BV, PREC=prec, num_warps=4)
    return o, ht, (G, Aqk, Tinv, w, h, U)


def _backward(q, k, v, g, beta, scale, h0, lower_bound, saved, do, dht):
    G, Aqk, Tinv, w, h, U = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    prec = _prec(q)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dh = torch.empty_like(h)
    dU = torch.empty_like(v)
    dh0 = torch.empty(B, H, K, V, **f32) if h0 is not None else None
    BVs = min(32, V)
    _state_bwd_kernel[(V // BVs, B * H)](q, k, G, w, Aqk, do, dh, dU, dht, dh0, scale, T, NT, H, K, V, BVs,
                                         HAS_DHT=dht is not None, STORE_DH0=h0 is not None, PREC=prec,
                                         num_warps=4, num_stages=2)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, H, CHUNK, **f32)
    dT = torch.empty(B, T, H, CHUNK, **f32)
    dbeta = torch.empty(B, T, H, **f32)
    BV = min(64, V)
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
    _bwd_pair_kernel[(K // BK, NT, B * H)](q, k, g, G, beta, Tinv, dT, dAqk, dq_p, dk_p, dG_p, dq, dk, dg, dbeta,
                                          scale, lower_bound or 0.0, T, H, K, BK, GATE=lower_bound is not None,
                                          PREC=prec, num_warps=4)
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0


class ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, lower_bound):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.float().contiguous()
        o, ht, saved = _forward(q, k, v, g, beta, scale, h0, output_final_state, lower_bound)
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved)
        ctx.scale, ctx.lower_bound = scale, lower_bound
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, ctx.scale, h0, ctx.lower_bound, saved, do,
                                               None if dht is None else dht.float().contiguous())
        return dq, dk, dv, dg, dbeta, None, dh0, None, None


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule on the GPU; differentiable in q, k, v, g, beta and initial_state.

    ``g`` is the per-channel log-decay (each entry >= ``G_MIN_SAFE``), or, with ``gate_lower_bound``
    set (e.g. -5), the raw gate logits: the kernel then computes ``g = gate_lower_bound * sigmoid(raw)``
    itself, fused with the chunk cumsum, and returns gradients w.r.t. the raw logits.
    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    for name, d in (("K", K), ("V", V)):
        # K = 32 gave non-finite bf16 gradients on the H200 (cause not found); 64 and 128 are tested there
        if d < 64 or d > 256 or d & (d - 1):
            raise ValueError(f"head dim {name}={d} must be 64, 128 or 256")
    if gate_lower_bound is None:
        if bool((g < G_MIN_SAFE).any()):
            raise ValueError(f"log-decay below {G_MIN_SAFE}: this kernel needs the bounded gate "
                             "(use gate_lower_bound or the PyTorch chunked path for unbounded decay)")
    elif not G_MIN_SAFE <= gate_lower_bound < 0:
        raise ValueError(f"gate_lower_bound must be in [{G_MIN_SAFE}, 0), got {gate_lower_bound}")
    scale = K**-0.5 if scale is None else scale
    return ChunkGatedDeltaRuleTriton.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                           gate_lower_bound)


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
