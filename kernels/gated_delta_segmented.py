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


class SegmentedGatedDelta(torch.autograd.Function):
    """``fn`` is a chunked gated-delta implementation with the signature of ``chunk_gated_delta_rule_triton``
    (differentiable in q, k, v, g, beta and initial_state, taking ``cu_seqlens`` with per-sequence states)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, fn: Callable, scale, gate_lower_bound, bounds: list[int],
                seg_tokens: int, output_final_state: bool):
        N, (_, _, H, K), V = len(bounds) - 1, q.shape, v.shape[-1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # states: fp32 (fp64 for tests)
        h0 = initial_state.to(acc) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=acc)
        plan = _segment_plan(bounds, seg_tokens)
        o = torch.empty_like(v)
        final = torch.empty(N, H, K, V, device=q.device, dtype=acc)
        incoming = []  # per segment: the states its sequences start from
        carry = None
        for a, b, cu, first, continues in plan:
            n = len(cu) - 1
            s0 = h0[first:first + n].clone()
            if continues:
                s0[0] = carry
            incoming.append(s0)
            o_s, ht = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale, initial_state=s0,
                         output_final_state=True, gate_lower_bound=gate_lower_bound,
                         cu_seqlens=torch.tensor(cu, device=q.device))
            o[:, a:b] = o_s
            final[first:first + n] = ht  # a sequence that goes on is overwritten by a later segment
            carry = ht[-1]
        ctx.save_for_backward(q, k, v, g, beta, *incoming)
        ctx.args = (fn, scale, gate_lower_bound, plan, N, initial_state is not None)
        return o, (final if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, *incoming = ctx.saved_tensors
        fn, scale, lower_bound, plan, N, has_h0 = ctx.args
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        dh0 = torch.zeros(N, *incoming[0].shape[1:], device=q.device, dtype=incoming[0].dtype)
        dcarry = None  # gradient of the state the current segment hands to the next one
        for (a, b, cu, first, continues), s0 in zip(reversed(plan), reversed(incoming)):
            n = len(cu) - 1
            xs = [x[:, a:b].detach().requires_grad_() for x in (q, k, v, g, beta)]
            s0 = s0.detach().requires_grad_()
            with torch.enable_grad():
                o_s, ht = fn(*xs, scale=scale, initial_state=s0, output_final_state=True,
                             gate_lower_bound=lower_bound, cu_seqlens=torch.tensor(cu, device=q.device))
            dht = dfinal[first:first + n].clone() if dfinal is not None else torch.zeros_like(ht)
            if dcarry is not None:  # the last sequence goes on into the next segment
                dht[-1] = dcarry
            *dxs, ds0 = torch.autograd.grad((o_s, ht), (*xs, s0), (do[:, a:b], dht))
            for gr, d in zip(grads, dxs):
                gr[:, a:b] = d
            own = 1 if continues else 0  # a carried first row is the previous segment's state, not an h0 row
            dh0[first + own:first + n] += ds0[own:]
            dcarry = ds0[0] if continues else None
        return (*grads, dh0 if has_h0 else None, None, None, None, None, None, None)


def segmented_gated_delta_rule(fn: Callable, q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, gate_lower_bound=None, cu_seqlens=None,
                               seg_tokens: int = 1 << 18):
    """``fn`` over segments of ``seg_tokens`` tokens (B = 1 rows; see the module doc). Same contract as ``fn``."""
    if q.shape[0] != 1:
        raise ValueError(f"segmented rows need B = 1 (pack sequences with cu_seqlens), got B = {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    return SegmentedGatedDelta.apply(q, k, v, g, beta, initial_state, fn, scale, gate_lower_bound, bounds,
                                     seg_tokens, output_final_state)
