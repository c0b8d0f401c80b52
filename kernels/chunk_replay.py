"""Exact incremental gated delta rule: decode / prefill pieces that reproduce the chunked forward bit for bit.

The learner scores a whole sequence with the chunked kernel: chunks of C tokens from the sequence start, the
fp32 state carried from chunk boundary to chunk boundary, each chunk's outputs from that state and the chunk's
own tokens (``kernels/chunked_gated_delta.py``). A server that decodes with the recurrent step
(``gated_delta_rule_step``), or prefills a turn as a chunk that starts mid-chunk, sums the same quantities in a
different order: rounding drift that grows with the context.

Here the server keeps what the chunked forward itself keeps: the fp32 state at the last chunk boundary and the
inputs (q, k, v, g, beta) of the r < C tokens since it (the "tail"). New tokens are appended to the tail and the
chunk kernel is replayed over [boundary, now) from the boundary state; whole chunks advance the boundary. A token's
output in a chunk depends only on the chunk's earlier tokens (causal tiles, a triangular solve, products whose
later rows are exact zeros), so the replayed outputs equal the whole-sequence forward's. The same idea as the
chunk-replay decode of the attention-gym gated-delta example (replay the chunk kernel over the partial chunk
from the last fp32 boundary state). Cost: each decoded token re-runs up to C tokens through the chunk kernel.

Tail rows hold [q | k | v | g | beta] per head in fp32 ([r, H, 3K + V + 1]): model-dtype q, k, v are exact in
fp32, so unpacking gives back the original values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# chunk_fn(q, k, v, g, beta, initial_state=..., output_final_state=...) -> (o, final state): the same chunk kernel
# entry, with the same arguments, as the learner's forward
ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

CHUNK_SIZE = 64  # kernels.gated_delta_rule's default chunk, the learner's


def tail_width(head_k_dim: int, head_v_dim: int) -> int:
    """Features per head of one tail row: q, k, g (K each), v (V), beta (1)."""
    return 3 * head_k_dim + head_v_dim + 1


def pack_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """q, k, g [n, H, K], v [n, H, V], beta [n, H] -> tail rows [n, H, 3K + V + 1] fp32."""
    return torch.cat([q.float(), k.float(), v.float(), g.float(), beta.float()[..., None]], dim=-1)


def unpack_tokens(rows: torch.Tensor, head_k_dim: int, dtype: torch.dtype):
    """Rows [B, n, H, F] -> (q, k, v in ``dtype``; g, beta fp32): [B, n, H, .], beta [B, n, H]."""
    K = head_k_dim
    V = rows.shape[-1] - 3 * K - 1
    # contiguous, as the learner's inputs are: a strided view can take another matmul kernel (another summation
    # order) on some CPUs
    q, k, v, g, beta = (x.contiguous() for x in rows.split([K, K, V, K, 1], dim=-1))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta[..., 0].contiguous()


def chunk_replay(
    chunk_fn: ChunkFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    tail: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Appends n new tokens of one sequence and returns their outputs as the whole-sequence chunked forward gives them.

    q, k, g [1, n, H, K]; v [1, n, H, V]; beta [1, n, H] (g as ``chunk_fn`` takes it: log-decay, or the gate
    logits when the kernel fuses the gate). state [1, H, K, V] fp32: the state at the last chunk boundary (None at
    the sequence start); tail [r, H, F] fp32 (``pack_tokens``): the r < chunk_size tokens since that boundary.
    Returns (o [1, n, H, V] in v.dtype, the state at the new last boundary, the new tail [r', H, F],
    r' = (r + n) mod chunk_size).
    """
    r, n, K = tail.shape[0], q.shape[1], q.shape[-1]
    if r >= chunk_size:
        raise ValueError(f"the tail holds the tokens since the last chunk boundary: < {chunk_size}, got {r}")
    rows = torch.cat([tail, pack_tokens(q[0], k[0], v[0], g[0], beta[0])])  # [r + n, H, F]
    full = rows.shape[0] - rows.shape[0] % chunk_size  # tokens in whole chunks: they move the boundary
    outs = []
    if full:
        o, state = chunk_fn(*unpack_tokens(rows[None, :full], K, v.dtype), initial_state=state, output_final_state=True)
        outs.append(o)
    if full < rows.shape[0]:
        o, _ = chunk_fn(*unpack_tokens(rows[None, full:], K, v.dtype), initial_state=state, output_final_state=False)
        outs.append(o)
    o = torch.cat(outs, dim=1)[:, r:]  # [1, n, H, V]: the tail's outputs were returned when it was appended
    return o, state, rows[full:]


def chunk_replay_decode(
    chunk_fn: ChunkFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    tails: list[torch.Tensor],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunk_replay`` for one new token of each of B sequences, in one kernel call: the rows (tail + token) are
    right-padded with zeros to the longest; padding comes after every real token, so it changes no real output.

    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; states [B, H, K, V] fp32 (boundary states); tails: B tensors
    [r_b, H, F]. Returns (o [B, H, V] in v.dtype, boundary states (advanced for rows whose token completed a
    chunk), new tails)."""
    rows = [torch.cat([t, pack_tokens(*(x[b : b + 1] for x in (q, k, v, g, beta)))]) for b, t in enumerate(tails)]
    lengths = torch.tensor([r.shape[0] for r in rows], device=q.device)  # [B], each <= chunk_size
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, m, H, F]
    o, final = chunk_fn(*unpack_tokens(padded, q.shape[-1], v.dtype), initial_state=states, output_final_state=True)
    out = o[torch.arange(len(rows), device=q.device), lengths - 1]  # [B, H, V]
    full = lengths == chunk_size  # [B]: the row is one whole chunk, its final state is the next boundary's
    states = torch.where(full[:, None, None, None], final, states)
    return out, states, [r[:0] if f else r for r, f in zip(rows, full.tolist())]
