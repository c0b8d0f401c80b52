"""Token chunks: token-local work over a long row, ``TOKEN_CHUNK`` tokens at a time.

At 1M tokens one layer's token-local intermediates dwarf its inputs and outputs: a KDA layer's q/k/v projections,
short convs, fp32 q/k norms and fp32 gate logits take ~57 GiB in the no-grad forward of the ``learner-bench``
preset (hidden 2048, 16 heads of 128), more in its recompute + backward. `over_tokens` runs such a function
chunk by chunk and concatenates its outputs, so only the row's inputs and outputs span T; the intermediates are
those of one chunk. With gradients enabled each chunk runs under non-reentrant ``torch.utils.checkpoint``
(recomputed in backward, as ``model.moe.Experts`` and ``learner.logprobs.head_logprobs`` do), so the backward
also holds one chunk's intermediates at a time.

    out[:, lo:hi] = fn(x[:, lo - h:hi], ...)[:, h:]     h = min(halo, lo)

``halo``: the short causal convs read W-1 earlier tokens. A chunk is computed from ``halo`` more tokens on its
left and their outputs dropped; the first token kept sees every tap it sees in the whole row (with ``pos_in_seg``
sliced alike, taps across a sequence start inside the halo are dropped as in the whole row, and the halo's own
first tokens, whose taps reach past the slice, are the dropped ones).

A row of at most ``TOKEN_CHUNK`` tokens is one plain call: ``fn(*args)``, exactly the code path without chunks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

# Tokens per chunk; also the segment length of a KDA layer on a longer B = 1 row (`LinearAttention._segmented`) and
# the unit of MLA's head groups (`GatedMLA._heads_per_group`). A KDA layer's token-local intermediates are ~57 KiB
# per token in the forward at learner-bench widths. With chunks, segments and head groups, no half-layer's
# recompute + backward of a 1M-token row holds more than 37 GiB beyond its inputs on the H200
# (benchmarks/learner/h200/README.md). Rows up to 64K tokens (the steady-state benchmark's) run unchunked.
TOKEN_CHUNK = 1 << 16


def over_tokens(fn: Callable[..., Any], *args: Any, dim: int = 1, halo: int = 0, chunk: int | None = None) -> Any:
    """``fn(*args)`` over ``chunk`` (default ``TOKEN_CHUNK``) tokens at a time -> its output (a tensor or a tuple of
    tensors, tokens on ``dim``), the chunks' outputs concatenated.

    args: tensors with their tokens on ``dim`` ([B, T, ...] for dim 1); 1-D tensors [T] (per-token values shared by
    the batch, as ``pos_in_seg``) on dim 0; anything else (None) goes to every chunk as is. T is the first
    tensor's. fn must be token-local but for ``halo`` tokens back (see the module docstring)."""
    step = TOKEN_CHUNK if chunk is None else chunk
    T = next(a for a in args if torch.is_tensor(a) and a.dim() > 1).shape[dim]
    if T <= step:
        return fn(*args)
    parts = []
    for lo in range(0, T, step):
        start, n = max(lo - halo, 0), min(step, T - lo)
        chunk = [_narrow(a, dim, start, lo + n - start) for a in args]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_drop_halo, fn, dim, lo - start, *chunk, use_reentrant=False))
        else:
            parts.append(_drop_halo(fn, dim, lo - start, *chunk))
    if torch.is_tensor(parts[0]):
        return torch.cat(parts, dim)
    columns = list(zip(*parts))  # one list per output, concatenated and released one after the other
    del parts
    out = []
    while columns:
        out.append(torch.cat(columns.pop(0), dim))
    return tuple(out)


def _narrow(a: Any, dim: int, start: int, length: int) -> Any:
    if not torch.is_tensor(a):
        return a
    return a.narrow(0 if a.dim() == 1 else dim, start, length)


def _drop_halo(fn: Callable[..., Any], dim: int, h: int, *args: Any) -> Any:
    """fn(*args) without the outputs of its first h tokens."""
    out = fn(*args)
    if h == 0:
        return out
    if torch.is_tensor(out):
        return out.narrow(dim, h, out.shape[dim] - h)
    return tuple(o.narrow(dim, h, o.shape[dim] - h) for o in out)
