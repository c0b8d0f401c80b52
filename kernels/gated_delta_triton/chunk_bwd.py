"""Backward kernels of the chunked gated delta rule: Aqk^T dO -> sequential reverse state pass -> value-side
grads -> state-side grads -> dAkk -> pair-matrix grads (one program per 16-row sub-tile) -> dg."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gated_delta_triton.chunk_fwd import STATE_CONFIGS, _state_configs
from kernels.gated_delta_triton.common import BC, BT, MIN_STEPS, _chunk_rows, _sequence, _state_step, _tile


@triton.jit
def _bwd_intra_dU_kernel(Aqk, do, dU, T, chunk_rows, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                         PREC: tl.constexpr, VARLEN: tl.constexpr):
    """dU = Aqk^T dO: the part of dU that does not depend on the state gradient (fp32 [B, T, H, V])."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    p_A, m_t = _tile(Aqk + (i_b * T * H + i_h) * BT, t0, t1, H * BT, 0, BT, BT)
    p_y, _ = _tile((i_b * T * H + i_h) * V, t0, t1, H * V, i_v * BV, BT, BV)
    b_dU = tl.dot(tl.trans(tl.load(p_A, mask=m_t, other=0.0).to(do.dtype.element_ty)),
                  tl.load(do + p_y, mask=m_t, other=0.0), input_precision=PREC)
    tl.store(dU + p_y, b_dU, mask=m_t)


@triton.autotune(configs=STATE_CONFIGS, key=["H", "K", "V", "PREC"], restore_value=["dU"],
                 prune_configs_by={"early_config_prune": _state_configs})
@triton.jit
def _state_bwd_kernel(qg, kd, G, w, do, dh, dU, dht, dh0, seqs, T, NT, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Reverse sequential pass over one sequence's chunks. dh[n] = dL/d(state at the end of chunk n)
    [B, NT, H, K, V]; dU += kd dS' (dU holds Aqk^T dO on entry);  dS = exp(G_L) dS' + qg^T dO - w^T dU.
    Each sequence starts from its dht row (or zero) and ends at its dh0 row, as in _state_fwd_kernel."""
    i_v, i_h, i_b, p_n, bos, eos, c0, nc = _sequence(T, NT, seqs, H, K, V, BV, VARLEN)
    o_k = tl.arange(0, K)
    kb = (i_b * T * H + i_h) * K
    vb = (i_b * T * H + i_h) * V
    o_s, _ = _tile(0, 0, K, V, i_v * BV, K, BV)  # this V-slice of one [K, V] state
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh = tl.load(dht + p_n + o_s)
    for i_r in range(tl.maximum(nc, MIN_STEPS)):
        live, j, t0, t1 = _state_step(i_r, bos, eos, nc, REVERSE=True)
        tl.store(dh + ((i_b * NT + c0 + j) * H + i_h).to(tl.int64) * K * V + o_s, b_dh.to(dh.dtype.element_ty),
                 mask=live)
        p_x, m_t = _tile(kb, t0, t1, H * K, 0, BT, K)
        p_y, m_y = _tile(vb, t0, t1, H * V, i_v * BV, BT, BV)
        b_kd = tl.load(kd + p_x, mask=m_t, other=0.0)  # [BT, K]
        b_qg = tl.load(qg + p_x, mask=m_t, other=0.0)
        b_w = tl.load(w + p_x, mask=m_t, other=0.0)
        b_do = tl.load(do + p_y, mask=m_y, other=0.0)  # [BT, BV]
        b_GL = tl.load(G + kb + (t1 - 1) * H * K + o_k)  # [K]
        b_dU = tl.load(dU + p_y, mask=m_y, other=0.0)
        b_dU += tl.dot(b_kd, b_dh.to(b_kd.dtype), input_precision=PREC)  # [BT, BV]
        tl.store(dU + p_y, b_dU, mask=m_y & live)
        b_new = b_dh * tl.exp(b_GL)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(b_qg.dtype), input_precision=PREC)
        b_new -= tl.dot(tl.trans(b_w), b_dU.to(b_w.dtype), input_precision=PREC)
        b_dh = tl.where(live, b_new, b_dh)
    if STORE_DH0:
        tl.store(dh0 + p_n + o_s, b_dh)


@triton.jit
def _bwd_value_kernel(v, beta, Tinv, U, dU, do, dv, dAqk, dT, dbeta, T, chunk_rows, H: tl.constexpr,
                      V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk: dAqk = dO U^T (masked i <= t), dT = dU (beta v)^T, dv = beta Tinv^T dU,
    dbeta = sum_v (Tinv^T dU) v. Writes dT and dbeta (later kernels add to them)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    o_i = tl.arange(0, BT)
    m_t = (t0 + o_i) < t1
    vb = (i_b * T * H + i_h) * V
    ab = (i_b * T * H + i_h) * BT
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    p_A, m_a = _tile(ab, t0, t1, H * BT, 0, BT, BT)
    b_Tt = tl.trans(tl.load(Tinv + p_A, mask=m_a, other=0.0)).to(v.dtype.element_ty)  # Tinv^T
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in tl.static_range(V // BV):
        p_y, m_y = _tile(vb, t0, t1, H * V, i_v * BV, BT, BV)
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


# One program per (K-slice, chunk): [BT, BK] accumulators, the state read [BV, BK] at a time. In fp32 at K = V = 256
# (3xTF32 splits each operand in two) BK = BV = 64 spilled 1,824 B a thread, BK = BV = 32 376 B (sm_90 compile,
# benchmarks/kernels/resources.py); smaller slices read dO, dU and U once per K-slice: the autotuner picks per shape.
SIDE_CONFIGS = [triton.Config({"BK": bk, "BV": bv}, num_warps=4) for bk, bv in ((64, 64), (64, 32), (32, 32))]


@triton.autotune(configs=SIDE_CONFIGS, key=["H", "K", "V", "PREC"], restore_value=["dT", "dbeta"])
@triton.jit
def _bwd_state_side_kernel(q, k, G, beta, Tinv, h, dh, U, dU, do, dq_p, dk_p, dG_p, dT, dbeta, scale, T, NT,
                           chunk_rows, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk and K-slice, the gradients that flow through the states: dQg = dO S^T, dw = -dU S^T,
    dKd = U dS'^T, the decay of S, and the WY input x = beta k exp(G) (dx = Tinv^T dw, dT += dw x^T).
    Writes partial dq, dk, dG [B, T, H, K] fp32; adds into dT and dbeta."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = (t0 + o_i) < t1
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
        p_y, m_y = _tile(vb, t0, t1, H * V, i_v * BV, BT, BV)
        b_dqg += tl.dot(tl.load(do + p_y, mask=m_y, other=0.0), b_h.to(do.dtype.element_ty), input_precision=PREC)
        b_dw -= tl.dot(tl.load(dU + p_y, mask=m_y, other=0.0).to(do.dtype.element_ty), b_h.to(do.dtype.element_ty),
                       input_precision=PREC)
        b_dkd += tl.dot(tl.load(U + p_y, mask=m_y, other=0.0), b_dh.to(U.dtype.element_ty), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
    p_x, m_x = _tile(kb, t0, t1, H * K, i_k * BK, BT, BK)
    b_q = tl.load(q + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_G = tl.load(G + p_x, mask=m_x, other=0.0)
    last = t1 - 1
    b_GL = tl.load(G + kb + last * H * K + o_k)  # [BK]
    b_eG = tl.exp(b_G)
    b_dq = scale * b_eG * b_dqg
    b_dG = b_dq * b_q
    b_dk = tl.exp(tl.where(m_t[:, None], b_GL[None, :] - b_G, 0.0)) * b_dkd
    b_dG -= b_dk * b_k
    b_dGL = tl.sum(b_dk * b_k, 0) + tl.exp(b_GL) * b_hdh  # [BK] grad of G_L
    # WY input x = beta k exp(G)
    b_b = tl.load(beta + (i_b * T + t0 + o_i) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    p_A, m_a = _tile(ab, t0, t1, H * BT, 0, BT, BT)
    b_T = tl.load(Tinv + p_A, mask=m_a, other=0.0).to(tl.float32)
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
def _bwd_dAkk_kernel(Tinv, dT, T, chunk_rows, H: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """dAkk = -Tinv^T dT Tinv^T (strictly lower), written over dT [B, T, H, BT] fp32, one chunk per program."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    o_i = tl.arange(0, BT)
    m_t = (t0 + o_i) < t1
    p_A = (i_b * T * H + i_h) * BT + (t0 + o_i)[:, None] * H * BT + o_i[None, :]
    b_T = tl.load(Tinv + p_A, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_d = tl.dot(tl.load(dT + p_A, mask=m_t[:, None], other=0.0), tl.trans(b_T), input_precision=PREC)
    b_d = -tl.dot(tl.trans(b_T), b_d, input_precision=PREC)
    tl.store(dT + p_A, tl.where(o_i[None, :] < o_i[:, None], b_d, 0.0), mask=m_t[:, None])


# One program per (K-slice, 16-row sub-tile): BK 64 with 2 warps and 3 stages won on the H200 (NOTES.md).
PAIR_CONFIGS = [triton.Config({"BK": bk}, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4)
                for ns in (2, 3)]


@triton.autotune(configs=PAIR_CONFIGS, key=["H", "K", "PREC"], restore_value=["dbeta", "dG"])
@triton.jit
def _bwd_pair_kernel(q, k, G, beta, dAkk, dAqk, dq_p, dk_p, dG, dq, dk, dbeta, scale, T, chunk_rows,
                     H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The pair terms of Aqk and Akk for one 16-row sub-tile i and one K-slice, as [16, 16] x [16, BK] products
    with fp32 operands. The gate gradient is a difference of nearly equal terms: the Aqk terms of dq (times q) and
    of dk (times k) cancel, so those two products run in 3xTF32 whatever PREC is (in tf32 their rounding errors
    do not cancel: 2.8x the gate-gradient error of the other gradients, 1.0x in 3xTF32, Triton's interpreter
    with TF32 emulated; measured on the GPU by benchmarks/kernels/breakdown.py); the Akk terms run in PREC.
    rows side over the key blocks j <= i (dq, d(beta k) of the sub-tile's rows, reference = its first row),
    columns side over the row blocks j >= i (dk of its keys, reference = its last valid row). Adds the
    state-side partials and writes dq, dk and dG, the gate gradient before the chunk's reverse cumsum
    (in place over the state-side partial dG)."""
    i_kc, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_k, i_i = i_kc // NC, i_kc % NC
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    n = t1 - t0  # valid rows of the chunk
    r0 = i_i * BC  # the sub-tile's first row inside the chunk
    if r0 >= n:
        return
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    kb = (i_b * T * H + i_h) * K
    ab = (i_b * T * H + i_h) * BT
    p_c, m_c = _tile(kb, t0 + r0, t1, H * K, i_k * BK, BC, BK)  # this sub-tile's rows  [BC, BK]
    b_Gc = tl.load(G + p_c, mask=m_c, other=0.0)
    b_Gr = tl.load(G + kb + (t0 + r0) * H * K + o_k)  # [BK]
    b_Gl = tl.load(G + kb + (t0 + tl.minimum(r0 + BC, n) - 1) * H * K + o_k)
    # rows side: keys of the blocks j <= i decayed to row r0 (exp(G_r0 - G_j) <= e^75 inside block i)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dbk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(0, i_i + 1):
        p_j, m_j = _tile(kb, t0 + i_j * BC, t1, H * K, i_k * BK, BC, BK)
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32)
        b_kj *= tl.exp(tl.where(m_j, b_Gr[None, :] - tl.load(G + p_j, mask=m_j, other=0.0), 0.0))
        p_a, _ = _tile(ab, t0 + r0, t1, H * BT, i_j * BC, BC, BC)  # dA[rows of i, keys of j]  [BC, BC]
        b_dq += tl.dot(tl.load(dAqk + p_a, mask=m_c, other=0.0), b_kj, input_precision="tf32x3")
        b_dbk += tl.dot(tl.load(dAkk + p_a, mask=m_c, other=0.0), b_kj, input_precision=PREC)
    f_r = tl.exp(tl.where(m_c, b_Gc - b_Gr[None, :], 0.0))  # <= 1
    b_dq *= scale * f_r
    b_dbk *= f_r
    # columns side: rows of the blocks j >= i decayed to row l (exp(G_t - G_l) <= e^75 inside block i)
    b_dkc = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(i_i, tl.minimum(NC, tl.cdiv(n, BC))):
        r_j = t0 + i_j * BC
        p_j, m_j = _tile(kb, r_j, t1, H * K, i_k * BK, BC, BK)
        f_j = tl.exp(tl.where(m_j, tl.load(G + p_j, mask=m_j, other=0.0) - b_Gl[None, :], 0.0))
        b_bj = tl.load(beta + (i_b * T + r_j + o_c) * H + i_h, mask=(r_j + o_c) < t1, other=0.0).to(tl.float32)
        b_qj = tl.load(q + p_j, mask=m_j, other=0.0).to(tl.float32) * f_j * scale
        b_kj = tl.load(k + p_j, mask=m_j, other=0.0).to(tl.float32) * f_j * b_bj[:, None]
        p_a, m_a = _tile(ab, r_j, t1, H * BT, r0, BC, BC)  # dA[rows of j, keys of i]  [BC, BC]
        b_dkc += tl.dot(tl.trans(tl.load(dAqk + p_a, mask=m_a, other=0.0)), b_qj, input_precision="tf32x3")
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
def _bwd_gate_kernel(g, dG, dg, lower_bound, T, chunk_rows, H: tl.constexpr, K: tl.constexpr,
                     BK: tl.constexpr, GATE: tl.constexpr, VARLEN: tl.constexpr):
    """dg = reverse cumsum of dG over the chunk (times the gate's derivative lower_bound * s (1 - s) when GATE),
    one chunk and K-slice per program; the backward of _gate_cumsum_kernel."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t0, t1 = _chunk_rows(i_t, T, chunk_rows, VARLEN)
    p_x, m_t = _tile((i_b * T * H + i_h) * K, t0, t1, H * K, i_k * BK, BT, BK)
    b_dG = tl.load(dG + p_x, mask=m_t, other=0.0)  # [BT, BK]
    b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG
    if GATE:
        b_s = tl.sigmoid(tl.load(g + p_x, mask=m_t, other=0.0).to(tl.float32))
        b_dg *= lower_bound * b_s * (1.0 - b_s)
    tl.store(dg + p_x, b_dg.to(dg.dtype.element_ty), mask=m_t)
