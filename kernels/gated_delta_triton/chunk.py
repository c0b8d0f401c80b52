"""The chunked gated delta rule on the GPU: host side (launch order, autograd, packed-row layout) of the
kernels in chunk_fwd.py and chunk_bwd.py."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.gated_delta_triton.chunk_bwd import (_bwd_dAkk_kernel, _bwd_gate_kernel, _bwd_intra_dU_kernel,
                                                  _bwd_pair_kernel, _bwd_state_side_kernel, _bwd_value_kernel,
                                                  _state_bwd_kernel)
from kernels.gated_delta_triton.chunk_fwd import (_gate_cumsum_kernel, _output_kernel, _pair_matrices_kernel,
                                                  _solve_wy_kernel, _state_fwd_kernel)
from kernels.gated_delta_triton.common import CHUNK, G_MIN_SAFE, _prec


MAX_CHUNKS = 65535  # the per-chunk kernels' chunk axis is a CUDA grid's y axis


def _state_grid(N: int, H: int, V: int):
    """Launch grid of the two state passes: one flat axis of (sequence, head, V-slice) programs, V-slices
    innermost (a packed row's N * H can exceed a grid's y limit of 65,535)."""
    return lambda meta: (N * H * (V // meta["BV"]),)


def _forward(q, k, v, g, beta, scale, h0, store_ht, lower_bound, packed, prec):
    """``packed``: None (B rows of T tokens), or a packed row's _PackedRow; ``prec``: the dots' precision
    (common._prec)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT, N, rows, seqs = _layout(B, T, packed)
    var = dict(VARLEN=packed is not None)
    f32 = dict(device=q.device, dtype=torch.float32)
    G = torch.empty(B, T, H, K, **f32)
    _gate_cumsum_kernel[(NT, B * H)](g, G, lower_bound or 0.0, T, rows, H, K, GATE=lower_bound is not None, **var)
    Aqk = torch.empty(B, T, H, CHUNK, device=q.device, dtype=q.dtype)  # the output and dU kernels read it so
    Akk = torch.empty(B, T, H, CHUNK, **f32)
    _pair_matrices_kernel[(CHUNK // 16, NT, B * H)](q, k, G, beta, Aqk, Akk, scale, T, rows, H, K, PREC=prec,
                                                    num_warps=4, **var)
    # every use of Tinv in the forward casts it to q's dtype; the backward's fp32 dots read its 16-bit values (as fla
    # keeps the solved Akk in k's dtype): half the bytes written here and read three times in the backward
    Tinv = torch.empty(B, T, H, CHUNK, device=q.device, dtype=q.dtype)
    w, kd, qg = torch.empty_like(k), torch.empty_like(k), torch.empty_like(q)
    u = torch.empty_like(v)
    BV = min(64, V)
    _solve_wy_kernel[(NT, B * H)](q, k, v, G, beta, Akk, Tinv, w, u, kd, qg, scale, T, rows, H, K, V, min(64, K),
                                  BV, PREC=prec, num_warps=4, **var)
    del Akk
    h = torch.empty(B, NT, H, K, V, device=q.device, dtype=q.dtype)
    U = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if store_ht else None
    _state_fwd_kernel[_state_grid(N, H, V)](kd, G, w, u, h, U, h0, ht, seqs, T, NT, H, K, V, HAS_H0=h0 is not None,
                                            STORE_HT=store_ht, PREC=prec, **var)
    o = torch.empty_like(v)
    _output_kernel[(V // BV, NT, B * H)](qg, h, Aqk, U, o, T, NT, rows, H, K, V, BV, PREC=prec, num_warps=4, **var)
    return o, ht, (G, Aqk, Tinv, w, kd, qg, h, U)


def _backward(q, k, v, g, beta, scale, h0, lower_bound, packed, prec, saved, do, dht):
    G, Aqk, Tinv, w, kd, qg, h, U = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT, N, rows, seqs = _layout(B, T, packed)
    var = dict(VARLEN=packed is not None)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dh = torch.empty_like(h)
    dU = torch.empty(B, T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    BV = min(64, V)
    _bwd_intra_dU_kernel[(V // BV, NT, B * H)](Aqk, do, dU, T, rows, H, V, BV, PREC=prec, num_warps=4, **var)
    _state_bwd_kernel[_state_grid(N, H, V)](qg, kd, G, w, do, dh, dU, dht, dh0, seqs, T, NT, H, K, V,
                                            HAS_DHT=dht is not None, STORE_DH0=h0 is not None, PREC=prec, **var)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, H, CHUNK, **f32)
    dT = torch.empty(B, T, H, CHUNK, **f32)
    dbeta = torch.empty(B, T, H, **f32)
    _bwd_value_kernel[(NT, B * H)](v, beta, Tinv, U, dU, do, dv, dAqk, dT, dbeta, T, rows, H, V, BV, PREC=prec,
                                   num_warps=4, **var)
    dq_p = torch.empty(B, T, H, K, **f32)
    dk_p = torch.empty(B, T, H, K, **f32)
    dG_p = torch.empty(B, T, H, K, **f32)
    _bwd_state_side_kernel[lambda meta: (K // meta["BK"], NT, B * H)](
        q, k, G, beta, Tinv, h, dh, U, dU, do, dq_p, dk_p, dG_p, dT, dbeta, scale, T, NT, rows, H, K, V, PREC=prec,
        **var)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g)
    _bwd_dAkk_kernel[(NT, B * H)](Tinv, dT, T, rows, H, PREC=prec, num_warps=4, **var)  # dT becomes dAkk
    _bwd_pair_kernel[lambda meta: (K // meta["BK"] * (CHUNK // 16), NT, B * H)](
        q, k, G, beta, dT, dAqk, dq_p, dk_p, dG_p, dq, dk, dbeta, scale, T, rows, H, K, PREC=prec, **var)
    BK = min(64, K)
    _bwd_gate_kernel[(K // BK, NT, B * H)](g, dG_p, dg, lower_bound or 0.0, T, rows, H, K, BK,
                                           GATE=lower_bound is not None, num_warps=4, **var)
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0


class ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """The kernels' autograd; ``packed`` as in ``_forward``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, lower_bound, packed):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.float().contiguous()
        prec = _prec(q)  # fixed at the forward: the backward runs at the same precision whatever is set by then
        o, ht, saved = _forward(q, k, v, g, beta, scale, h0, output_final_state, lower_bound, packed, prec)
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved)
        ctx.scale, ctx.lower_bound, ctx.packed, ctx.prec = scale, lower_bound, packed, prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, ctx.scale, h0, ctx.lower_bound, ctx.packed,
                                               ctx.prec, saved, do, None if dht is None else dht.float().contiguous())
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


class _PackedRow(NamedTuple):
    """A packed row for the kernels. chunk_rows [NT, 2] int32: first and end token of each chunk (a sequence's
    chunks start at its first token, its last chunk ends with it). seqs [N, 4] int32: per sequence (index, first
    token, end token, first chunk), longest first, so the state passes start their longest walks first."""

    chunk_rows: torch.Tensor
    seqs: torch.Tensor


@functools.lru_cache(maxsize=16)
def _packed_row(bounds: tuple[int, ...], device: torch.device) -> _PackedRow:
    """The tables of a packed row with sequence bounds ``bounds`` (cu_seqlens as a tuple)."""
    cu = torch.tensor(bounds)
    n_chunks = (cu.diff() + CHUNK - 1).div(CHUNK, rounding_mode="floor")
    first_chunk = n_chunks.cumsum(0) - n_chunks
    seq = torch.repeat_interleave(torch.arange(len(n_chunks)), n_chunks)  # chunk -> sequence
    t0 = cu[seq] + (torch.arange(len(seq)) - first_chunk[seq]) * CHUNK
    rows = torch.stack([t0, torch.minimum(t0 + CHUNK, cu[seq + 1])], 1)
    order = torch.argsort(n_chunks, descending=True, stable=True)
    seqs = torch.stack([order, cu[order], cu[order + 1], first_chunk[order]], 1)
    return _PackedRow(*(x.to(device=device, dtype=torch.int32).contiguous() for x in (rows, seqs)))


def _layout(B: int, T: int, packed: _PackedRow | None):
    """(chunks NT, sequences N, chunk_rows, seqs) of B rows of T tokens or of a packed row."""
    if packed is None:
        return -(-T // CHUNK), B, None, None
    return packed.chunk_rows.shape[0], packed.seqs.shape[0], *packed


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

    Any length works and nothing is copied: a chunk is at most CHUNK tokens of one sequence (a sequence's last
    chunk may be shorter), every chunk runs in parallel outside the two sequential state passes, and those run
    the sequences of a packed row in parallel (one program per sequence, head and V-slice).
    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if T == 0:
        raise ValueError("empty row: T must be at least 1")
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
    packed = None if cu_seqlens is None else _packed_row(bounds, q.device)
    n_chunks = _layout(B, T, packed)[0]
    if n_chunks > MAX_CHUNKS:
        raise ValueError(f"{n_chunks} chunks of {CHUNK} tokens in one row, over the {MAX_CHUNKS} a launch grid's axis "
                         "holds: cut the row (kernels.gated_delta_rule runs long rows segment by segment)")
    return ChunkGatedDeltaRuleTriton.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                           gate_lower_bound, packed)
