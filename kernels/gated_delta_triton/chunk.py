"""The chunked gated delta rule on the GPU: host side (launch order, autograd, packed-row layout) of the
kernels in chunk_fwd.py and chunk_bwd.py."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.gated_delta_triton.chunk_bwd import (_bwd_dAkk_kernel, _bwd_gate_kernel, _bwd_intra_dU_kernel,
                                                  _bwd_pair_kernel, _bwd_state_side_kernel, _bwd_value_kernel,
                                                  _state_bwd_kernel)
from kernels.gated_delta_triton.chunk_fwd import (_gate_cumsum_kernel, _output_kernel, _pair_matrices_kernel,
                                                  _solve_wy_kernel, _state_fwd_kernel)
from kernels.gated_delta_triton.common import CHUNK, FIRST, G_MIN_SAFE, LAST, _prec


def _forward(q, k, v, g, beta, scale, h0, store_ht, lower_bound, chunks):
    """All kernels see whole chunks: T is a multiple of CHUNK (the wrapper pads). ``chunks``: None, or
    (chunk_seq, chunk_flags, N) for a packed row of N chunk-aligned sequences."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // CHUNK
    N = B if chunks is None else chunks[2]
    chunk_seq, chunk_flags = (None, None) if chunks is None else chunks[:2]
    prec = _prec(q, v)
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
    prec = _prec(q, v)
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


# A row of fewer chunks than the deepest software pipeline of the sequential state kernels (STATE_CONFIGS'
# num_stages, at most 3) faulted on the H200 in bf16 (illegal memory access in _state_fwd_kernel at T = 1, 63, 64
# with 2 heads of 64; Triton 3.6, torch 2.11): such a row is padded with no-op chunks to this many.
MIN_CHUNKS = 3


@functools.lru_cache(maxsize=16)
def _packed_layout(bounds: tuple[int, ...], device: torch.device):
    """Chunk-aligned layout of a packed row with sequence bounds ``bounds`` (cu_seqlens): sequence i starts at
    a multiple of CHUNK; no-op chunks after the last one bring the row to MIN_CHUNKS (they continue the last
    sequence, after its final state is stored). Returns (token -> padded position [T] int64, or None when every
    sequence is already aligned; padded length; chunk -> sequence [NT] int32; chunk flags [NT] int32 (FIRST |
    LAST))."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    chunks = [-(-n // CHUNK) for n in lengths]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c * CHUNK)
    dst = None
    if any(n % CHUNK for n in lengths[:-1]):  # an unaligned last sequence is only padded at the end
        dst = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(device)
    tail = max(0, MIN_CHUNKS - sum(chunks))
    seq = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(chunks))
    seq = torch.cat([seq, seq.new_full((tail,), len(lengths) - 1)])
    first = torch.tensor(starts[:-1]) // CHUNK
    flags = torch.zeros(len(seq), dtype=torch.int32)
    flags[first] |= FIRST.value
    flags[first + torch.tensor(chunks) - 1] |= LAST.value
    return dst, starts[-1] + tail * CHUNK, seq.to(device), flags.to(device)


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
    already fills whole chunks; a row shorter than MIN_CHUNKS chunks gets no-op chunks up to that many.
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
