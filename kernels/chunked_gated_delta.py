"""Chunked gated delta rule (KDA-style) in plain PyTorch: the tiling a fast kernel uses, written readably.

Per batch row and head, split the sequence into chunks of C tokens (64). Inside a chunk let ``G_t`` be the
inclusive cumulative sum of the log-decay ``g`` from the chunk start (per key channel, fp32), ``S`` the state
entering the chunk and ``u_t = beta_t (v_t - S_{t-1}'^T k_t)`` the value actually written at step t (S' is
the decayed state). Unrolling the recurrence (see ``kernels/gated_delta.py``) gives, for t, s in the chunk:

    A[t, s]   = beta_t <k_t * exp(G_t - G_s), k_s>      s < t      (strictly lower, C x C)
    Aqk[t, s] =        <q_t * exp(G_t - G_s), k_s>      s <= t
    (I + A) u = beta * v - (beta * k * exp(G)) S        =>  u = U - W S,  with the WY / UT transform
    U = (I + A)^-1 (beta * v),   W = (I + A)^-1 (beta * k * exp(G))
    o = scale * ((q * exp(G)) S + Aqk u)
    S_next = exp(G_C) * S + (k * exp(G_C - G))^T u

``A``, ``Aqk``, ``U`` and ``W`` depend only on the chunk itself, so they are computed for all chunks at
once; only the three state lines run sequentially over chunks.

The C x C matrices are built from 16-token tiles as matrix products. For the row tile i with reference
``r = G`` just before the tile, ``exp(G_t - G_s) = exp(G_t - r) * exp(r - G_s)``: the row factor is <= 1; the
column factor is <= 1 for tokens of earlier tiles, and for the diagonal tile it is the in-tile reciprocal
decay ``exp(-(g_first + ... + g_s))``, which grows with the tile's total decay. With the bounded gate
``g >= -5`` it stays <= exp(80), finite in fp32 and bf16 (max ~3.4e38 = exp(88.7)); with an unbounded
gate (``-softplus``) it overflows to inf (and the matching row factor underflows to 0, giving nan) - which
is why the model bounds the gate.

Precision, as a fast kernel would do it: every matrix product takes its operands in the input dtype
(``k.dtype``; bf16 inputs give bf16 tile products; the state too is rounded when it enters a product, as a
kernel loads it for a tensor-core dot) and accumulates in fp32. Cumulative sums, exponentials,
the triangular solve for ``(I + A)^-1``, ``A`` itself and the recurrent state are fp32. ``o`` is returned in
``v.dtype``, the final state in fp32 (fp64 inputs compute everything in fp64, for tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

TILE = 16


SEGMENT_TOKENS = 4096  # rows longer than this train segment by segment (kernels/gated_delta_segmented.py)
# Packed sequences run as a zero-padded batch [N, T_max] (their chunks in parallel) while that costs at most this
# factor over laying them end to end on chunk boundaries (one row, every chunk in turn: memory linear in T
# whatever the length spread, but N times the sequential steps: many short episodes ran 1.4x slower end to end)
PAD_WASTE = 2.0


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    exact_diagonal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H].

    ``exact_diagonal`` builds the diagonal 16-token tiles from pairwise decays ``exp(G_t - G_s)``, s <= t
    (elementwise over K, no matrix product), instead of the factorised in-tile reciprocal decay: slower, but
    finite for an unbounded gate (``-softplus``), whose reciprocal decay overflows.

    ``cu_seqlens`` (int64 [N + 1], B must be 1) packs N sequences along T; the state resets at each boundary
    and ``initial_state`` / the final state then have N rows. Returns (o [B, T, H, V] in v.dtype,
    final state [B or N, H, K, V] fp32 or None).

    Memory is linear in T: packed sequences are laid out on chunk boundaries (each padded to a multiple of
    ``chunk_size``, not to the longest), and a B = 1 row longer than ``SEGMENT_TOKENS`` that needs gradients
    runs ``SEGMENT_TOKENS`` tokens at a time with the state carried across the cuts, each segment recomputed in
    backward (``kernels.gated_delta_segmented``): the fp32 intermediates the backward keeps (a few hundred
    bytes per token and head) then exist for one segment at a time.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T = q.shape[:2]
    grads = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if B == 1 and T > SEGMENT_TOKENS and grads:
        from kernels.gated_delta_segmented import segmented_gated_delta_rule

        return segmented_gated_delta_rule(
            functools.partial(_segment, chunk_size=chunk_size, exact_diagonal=exact_diagonal), q, k, v, g, beta,
            scale, initial_state, output_final_state, None, cu_seqlens, seg_tokens=SEGMENT_TOKENS,
        )
    return _rows(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, exact_diagonal)


def _segment(q, k, v, g, beta, *, scale, initial_state, output_final_state, gate_lower_bound, cu_seqlens,
             chunk_size, exact_diagonal):
    """One segment for ``segmented_gated_delta_rule`` (its kernel signature; g is already the log-decay)."""
    assert gate_lower_bound is None
    return _rows(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, exact_diagonal)


def _rows(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, exact_diagonal):
    if cu_seqlens is None:
        return _chunked(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, exact_diagonal)

    C = chunk_size
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    starts = [0]  # each sequence's first token in the laid-out row, and its end
    for n in lengths:
        starts.append(starts[-1] + -(-n // C) * C)
    if len(lengths) * -(-max(lengths) // C) * C <= PAD_WASTE * starts[-1]:
        return _batched(q, k, v, g, beta, scale, initial_state, output_final_state, bounds, lengths, C, exact_diagonal)

    # Packed sequences laid end to end, each padded to a multiple of the chunk: [1, T', H, ...] with T' <= T +
    # N (C - 1). Padding tokens have k = 0, beta = 0 and g = 0 (no decay), so they leave the state untouched;
    # the state resets where each sequence's first chunk starts, and each final state is read after its last.
    shift = torch.tensor([s - lo for s, lo in zip(starts[:-1], bounds[:-1])], device=q.device)
    dest = torch.arange(bounds[-1], device=q.device) + torch.repeat_interleave(
        shift, torch.tensor(lengths, device=q.device))  # [T]: each token's place in the laid-out row

    def lay(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(1, starts[-1], *x.shape[2:]).index_copy(1, dest, x)

    o, final_state = _chunked(*(lay(x) for x in (q, k, v, g, beta)), scale, initial_state, output_final_state, C,
                              exact_diagonal, seq_chunks=[s // C for s in starts])
    return o.index_select(1, dest), final_state  # [1, T, H, V]


def _batched(q, k, v, g, beta, scale, initial_state, output_final_state, bounds, lengths, chunk_size,
             exact_diagonal):
    """Packed sequences as a zero-padded batch [N, T_max, H, ...]: padding tokens have k = 0, beta = 0 and g = 0
    (no decay), so they leave the state untouched and each final state is its sequence's own."""
    padded = [pad_sequence([x[0, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])], batch_first=True)
              for x in (q, k, v, g, beta)]
    o, final_state = _chunked(*padded, scale, initial_state, output_final_state, chunk_size, exact_diagonal)
    valid = torch.arange(o.shape[1], device=o.device) < torch.tensor(lengths, device=o.device)[:, None]  # [N, T_max]
    return o[valid].unsqueeze(0), final_state  # [1, T, H, V]


def _chunked(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, exact_diagonal,
             seq_chunks: list[int] | None = None):
    """Rows of B sequences; or (``seq_chunks``, B = 1) one row of sequences laid out on chunk boundaries,
    sequence i in chunks seq_chunks[i] .. seq_chunks[i + 1] - 1 (initial / final states: one row each)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    dtype = k.dtype  # operand dtype of every matrix product
    acc = torch.promote_types(dtype, torch.float32)  # accumulation / state dtype: fp32 (fp64 for fp64 inputs)
    pad = -T % C  # padded tail tokens: k = 0, beta = 0, g = 0 -> no effect on the state

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...] in acc
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        x = x.reshape(B, (T + pad) // C, C, *x.shape[2:])
        return x.movedim(3, 1).to(acc)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)  # [B, H, N, C, K or V]
    beta = chunks(beta).unsqueeze(-1)  # [B, H, N, C, 1]
    gc = g.cumsum(-2)  # [B, H, N, C, K], inclusive, restarts at each chunk
    # Decay exponents near a reference are summed outward from it, not taken as differences of gc: gc reaches
    # -5 * 64 = -320 in a chunk and differences of such fp32 sums lose ~|gc| * 6e-8 exactly where the
    # factor exp(.) is large. tile_cum: inclusive cumsum restarting at each 16-token tile, [B, H, N, C, K].
    tile_cum = g.unflatten(-2, (C // TILE, TILE)).cumsum(-2).flatten(-3, -2)

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b with operands rounded to the input dtype and fp32 accumulation (a tensor-core dot)."""
        return a.to(dtype).to(acc) @ b.to(dtype).to(acc)

    # Intra-chunk scores from 16-token tiles (module docstring): A and Aqk, [B, H, N, C, C] fp32.
    # Row tile i, reference r = gc just before the tile: exp(G_t - G_s) = exp(G_t - r) * exp(r - G_s).
    A = q.new_zeros(*gc.shape[:-1], C)
    Aqk = q.new_zeros(*gc.shape[:-1], C)
    in_tile_causal = torch.ones(TILE, TILE, dtype=torch.bool, device=q.device).tril()  # s <= t
    for i in range(C // TILE):
        rows = slice(i * TILE, (i + 1) * TILE)
        cols = slice(0, i * TILE) if exact_diagonal else slice(0, (i + 1) * TILE)
        row_decay = tile_cum[..., rows, :].exp()  # exp(G_t - r), [.., TILE, K], <= 1
        # r - G_s: <= 0 for earlier tiles (the decay from s to the tile start); for the diagonal tile
        # -tile_cum, the in-tile reciprocal decay: <= 80 for g >= -5, overflowing exp for an unbounded gate.
        col_log = _sum_after(g[..., : i * TILE, :])
        if not exact_diagonal:
            col_log = torch.cat([col_log, -tile_cum[..., rows, :]], dim=-2)
        k_cols = (k[..., cols, :] * col_log.exp()).transpose(-1, -2)  # [.., K, len(cols)]
        A[..., rows, cols] = dot(k[..., rows, :] * row_decay, k_cols)
        Aqk[..., rows, cols] = dot(q[..., rows, :] * row_decay, k_cols)
        if exact_diagonal:  # pairwise exp(G_t - G_s) <= 1 for s <= t: [.., TILE(t), TILE(s), K]
            log_decay = tile_cum[..., rows, None, :] - tile_cum[..., None, rows, :]
            decay = log_decay.masked_fill(~in_tile_causal[..., None], float("-inf")).exp()
            A[..., rows, rows] = torch.einsum("...tk,...sk,...tsk->...ts", k[..., rows, :], k[..., rows, :], decay)
            Aqk[..., rows, rows] = torch.einsum("...tk,...sk,...tsk->...ts", q[..., rows, :], k[..., rows, :], decay)
    A = (A * beta).tril(-1)  # A[t, s] = beta_t <k_t exp(G_t - G_s), k_s>, s < t
    Aqk = Aqk.tril()  # s <= t; tril also drops the (large, unused) s > t entries of the diagonal tiles

    # UT transform: (I + A)^-1 by a unit-lower-triangular solve in fp32, then the WY factors.
    eye = torch.eye(C, dtype=acc, device=A.device)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = dot(inv, beta * k * gc.exp())  # [B, H, N, C, K]
    U = dot(inv, beta * v)  # [B, H, N, C, V]

    # Inter-chunk recurrence: the only sequential part, one step per chunk. The state stays fp32.
    q_decayed = q * gc.exp()  # [B, H, N, C, K], decay from the chunk start to each token
    k_to_end = k * _sum_after(g).exp()  # [B, H, N, C, K], decay from each token to the chunk end
    chunk_decay = gc[..., -1, :].exp().unsqueeze(-1)  # [B, H, N, K, 1]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)  # [B, H, K, V]
    first = {} if seq_chunks is None else {n: i for i, n in enumerate(seq_chunks)}  # chunk -> sequence it starts
    finals = []
    out = []
    for n in range(gc.shape[2]):
        if n in first:  # a packed sequence starts: its own initial state
            i = first[n]
            S = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[i : i + 1].to(acc)
        u = U[:, :, n] - dot(W[:, :, n], S)  # [B, H, C, V], the values actually written
        out.append(dot(q_decayed[:, :, n], S) + dot(Aqk[:, :, n], u))  # [B, H, C, V]
        S = S * chunk_decay[:, :, n] + dot(k_to_end[:, :, n].transpose(-1, -2), u)
        if n + 1 in first:
            finals.append(S)
    o = torch.stack(out, dim=2) * scale  # [B, H, N, C, V]
    o = o.movedim(1, 3).reshape(B, T + pad, H, V)[:, :T]  # [B, T, H, V]
    if seq_chunks is not None:
        S = torch.cat(finals)  # [N, H, K, V]
    return o.to(v.dtype), (S if output_final_state else None)


def _sum_after(x: torch.Tensor) -> torch.Tensor:
    """y[..., s, :] = sum of x[..., u, :] over u > s (along dim -2), summed from the end backwards."""
    return x.flip(-2).cumsum(-2).flip(-2) - x


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size):
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k and g must share [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H]; got {tuple(v.shape)}, {tuple(beta.shape)}")
    if chunk_size <= 0 or chunk_size % TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {TILE}, got {chunk_size}")
    if bool((g > 0).any()):
        raise ValueError("g is a log-decay and must be <= 0")
    rows = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T and needs B == 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or bool((cu_seqlens.diff() <= 0).any()):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T = {T}, got {cu_seqlens.tolist()}")
        rows = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (rows, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be {(rows, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}")
