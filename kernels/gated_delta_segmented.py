"""The gated delta rule over a very long row, one segment of tokens at a time (bounded memory at 1M tokens).

The chunked kernel keeps fp32 intermediates of a few hundred bytes per token and head for its backward (the
chunk-start states alone are K * V * 2 bytes per 64 tokens and head): about 108 GiB for one layer of 16 heads
of 128 at 1M tokens on the H200 (benchmarks/kernels). Split along T, the recurrence only needs the state that
crosses each cut, so:

    forward:  run segment s from the state that segment s - 1 ended in, without saving its intermediates;
              keep only each segment's incoming state ([N_s, H, K, V] fp32, a few MiB)
    backward: for s = last .. first, recompute segment s from its incoming state and back-propagate its output
              gradient plus the gradient of the state it handed on (from segment s + 1's backward)

This is the single-device form of the state passing that context parallelism does across ranks (fla's
``fla/ops/cp``, LASP-2 arXiv 2502.07563): peak memory is one segment's, at the cost of one extra forward of the
linear-attention kernel (the layer is usually recomputed under activation checkpointing anyway).

Packed rows: a sequence may span several segments (its state is carried) and a segment may hold many
sequences (each with its own initial state row, reset as ``cu_seqlens`` says).

`state_passing_segments` is the mechanism for any function of that shape: the kernel alone
(`segmented_gated_delta_rule`), or a whole linear-attention layer whose token-local work (projections, short
convs, output gate) runs inside each segment, so nothing but the layer's input and output spans the row
(`model.attention.linear`). Short causal convs read a few tokens back: ``halo`` earlier tokens go into each
segment's call and the function drops their outputs (as `model.chunking.over_tokens` does). Gradients of
parameters the function uses accumulate into their ``.grad`` during the backward's recompute (as reentrant
activation checkpointing does); the inputs' and the initial state's gradients are returned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _segment_plan(bounds: list[int], seg_tokens: int) -> list[tuple[int, int, list[int], int, bool]]:
    """Cut [0, T) every ``seg_tokens`` tokens. Per segment: (start, end, local cu_seqlens, index of its first
    sequence, whether that sequence began in an earlier segment)."""
    T = bounds[-1]
    plan = []
    for a in range(0, T, seg_tokens):
        b = min(a + seg_tokens, T)
        first = max(i for i, x in enumerate(bounds[:-1]) if x <= a)  # sequence holding token a
        cuts = [x - a for x in bounds if a < x < b]
        plan.append((a, b, [0, *cuts, b - a], first, bounds[first] < a))
    return plan


class _StatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, bounds: list[int], seg_tokens: int, halo: int, h0: torch.Tensor, *tensors):
        plan = _segment_plan(bounds, seg_tokens)
        out, final, incoming, carry = None, torch.empty_like(h0), [], None
        for a, b, cu, first, continues in plan:
            n, h = len(cu) - 1, min(halo, a)
            s0 = h0[first:first + n].clone()
            if continues:
                s0[0] = carry
            incoming.append(s0)
            o_s, ht = fn(*(t[:, a - h:b] for t in tensors), initial_state=s0,
                         cu_seqlens=torch.tensor(cu, device=h0.device), halo=h)
            if out is None:
                out = o_s.new_empty(o_s.shape[0], bounds[-1], *o_s.shape[2:])
            out[:, a:b] = o_s
            final[first:first + n] = ht  # a sequence that goes on is overwritten by a later segment
            carry = ht[-1]
        ctx.save_for_backward(*tensors, *incoming)
        ctx.args = (fn, plan, halo, len(tensors), h0.shape[0])
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        fn, plan, halo, n_tensors, N = ctx.args
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no second unpack)
        tensors, incoming = saved[:n_tensors], saved[n_tensors:]
        wants = ctx.needs_input_grad[5:]
        grads = [torch.zeros_like(t) if w else None for t, w in zip(tensors, wants)]
        dh0 = incoming[0].new_zeros(N, *incoming[0].shape[1:])
        dcarry = None  # gradient of the state the current segment hands to the next one
        for (a, b, cu, first, continues), s0 in zip(reversed(plan), reversed(incoming)):
            n, h = len(cu) - 1, min(halo, a)
            xs = [t[:, a - h:b].detach().requires_grad_(w) for t, w in zip(tensors, wants)]
            s0 = s0.detach().requires_grad_()
            with torch.enable_grad():
                o_s, ht = fn(*xs, initial_state=s0, cu_seqlens=torch.tensor(cu, device=s0.device), halo=h)
            dht = dfinal[first:first + n].clone() if dfinal is not None else torch.zeros_like(ht)
            if dcarry is not None:  # the last sequence goes on into the next segment
                dht[-1] = dcarry
            pairs = [(t, d) for t, d in ((o_s, dout[:, a:b]), (ht, dht)) if t.requires_grad]
            torch.autograd.backward([t for t, _ in pairs], [d for _, d in pairs])
            for gr, x in zip(grads, xs):
                if gr is not None and x.grad is not None:
                    gr[:, a - h:b] += x.grad
            ds0 = s0.grad if s0.grad is not None else torch.zeros_like(s0)
            own = 1 if continues else 0  # a carried first row is the previous segment's state, not an h0 row
            dh0[first + own:first + n] += ds0[own:]
            dcarry = ds0[0] if continues else None
        return (None, None, None, None, dh0, *grads)


def state_passing_segments(fn: Callable, tensors: list[torch.Tensor], initial_state: torch.Tensor,
                           bounds: list[int], seg_tokens: int, halo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` over the row ``seg_tokens`` tokens at a time, each sequence's state carried across the cuts.

    tensors: [1, T, ...] (tokens on dim 1); initial_state [N, ...]: one per sequence of ``bounds`` (cu_seqlens as
    a list, N + 1 entries). ``fn(*slices, initial_state=[n, ...], cu_seqlens=[n + 1], halo=h)`` gets each tensor's
    tokens [a - h, b) (h = min(halo, a)) and returns (out [1, b - a, ...] for the tokens [a, b) only, the final
    states [n, ...]); cu_seqlens is local to [a, b). Returns (out [1, T, ...], final states [N, ...]). In the
    backward each segment is recomputed from its incoming state (see the module doc)."""
    return _StatePassing.apply(fn, bounds, seg_tokens, halo, initial_state, *tensors)


def segmented_gated_delta_rule(fn: Callable, q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, gate_lower_bound=None, cu_seqlens=None,
                               seg_tokens: int = 1 << 18):
    """``fn`` (a chunked gated-delta implementation with the signature of ``chunk_gated_delta_rule_triton``,
    differentiable in q, k, v, g, beta and initial_state, taking ``cu_seqlens`` with per-sequence states) over
    segments of ``seg_tokens`` tokens (B = 1 rows; see the module doc). Same contract as ``fn``."""
    if q.shape[0] != 1:
        raise ValueError(f"segmented rows need B = 1 (pack sequences with cu_seqlens), got B = {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    N, (_, _, H, K), V = len(bounds) - 1, q.shape, v.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # states: fp32 (fp64 for tests)
    h0 = initial_state.to(acc) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=acc)

    def segment(q, k, v, g, beta, initial_state, cu_seqlens, halo):
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                  gate_lower_bound=gate_lower_bound, cu_seqlens=cu_seqlens)

    o, final = state_passing_segments(segment, [q, k, v, g, beta], h0, bounds, seg_tokens)
    return o, (final if output_final_state else None)
