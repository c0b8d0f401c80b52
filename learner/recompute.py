"""Selective recompute: gradient checkpointing only for rows of at least ``learner.recompute_min_tokens`` tokens,
and on those only for the first ``learner.recompute_layers`` decoder layers.

Full checkpointing runs every half-layer's forward twice (forward, then recompute in backward) to keep one [T, D]
input per half between the two. A short row's activations fit beside the model states: there the recompute only
costs time. ``checkpoint_selected`` wraps the model's checkpoint function (the seam ``learner/offload.py`` uses;
the model is unchanged): a half-layer whose row has fewer than ``min_tokens`` tokens (``offload.row_tokens``: under
context parallelism the rank's shard) runs plainly, its activations kept for the backward
(``model.memory.layer_activations``); longer rows are checkpointed as before.

``layers`` (None: all) checkpoints, on a checkpointed row, only the halves of the first ``layers`` decoder layers
in forward order; the later ones run plainly and keep their activations, so a row too long to run without any
recompute trades the memory it has left for part of the recompute time. A half is told to its layer by the
checkpointed function's owner (``fn.__self__``, the ``DecoderLayer`` of ``run(self.mixer_half, ...)``): owners are
numbered in order of first appearance, once for the wrapper's lifetime (the layer order is fixed), so every
forward, and any recompute, decides alike for a layer.

``layers = "auto"`` (`AutoLayers`) picks that number per row: the fewest layers whose predicted peak
(``model.memory.learner_memory``, the learner's own states and the row's activations) stays under a share of the
device's memory, all of them when none does. Rows are bucketed by length (16 buckets per power of two, rounded up),
so the prediction runs once per bucket. The learner tells it whether the micro-batch it runs accumulates into
gradients held from earlier ones (an update's first micro-batch runs its forward with none allocated): the first
micro-batch of an update may keep more layers than the later ones.

The CP ranks of a row hold equal shards, so they decide alike (a recompute repeats the forward's collectives).
Data-parallel replicas train different rows: under ZeRO-3, which gathers the parameters again for each recompute,
the learner refuses the per-row choices (``min_tokens``, ``layers = "auto"``); a fixed ``layers`` recomputes the same
layers on every replica and is allowed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from learner.offload import row_tokens, wrap_checkpoint_fn


Layers = int | Callable[[int], int] | None  # how many layers to checkpoint: all (None), k, or k(T) per row


def checkpoint_selected(checkpoint_fn: Callable[..., Any], min_tokens: int, layers: Layers = None) -> Callable[..., Any]:
    """``checkpoint_fn`` (``torch.utils.checkpoint.checkpoint``-like) for rows [B, T, D] with T >= ``min_tokens``
    whose function's owner is one of the first ``layers`` owners seen (None: every one; a function: ``layers(T)``);
    ``fn(*args, **kwargs)`` without checkpointing otherwise."""
    order: dict[Any, int] = {}  # owner (the decoder layer): its index in forward order, kept across forwards

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        index = order.setdefault(getattr(fn, "__self__", fn), len(order))
        T = row_tokens(args)
        k = layers(T) if callable(layers) else layers
        if T < min_tokens or (k is not None and index >= k):
            return fn(*args, **kwargs)
        return checkpoint_fn(fn, *args, **kwargs)

    return run


def fitting_layers(predict: Callable[[int, int], int], num_layers: int, budget: int) -> Callable[[int], int]:
    """T -> the fewest of ``num_layers`` layers to checkpoint so that ``predict(T, k)`` (peak bytes of a row of T
    tokens with the first k layers checkpointed, falling in k) is at most ``budget``; ``num_layers`` if none fits.
    T is rounded up to one of 16 buckets per power of two (at most 6.25% more), each searched once."""

    @functools.lru_cache(maxsize=None)
    def bucket(T: int) -> int:
        lo, hi = 0, num_layers  # predict(T, hi) is the least; find the smallest k that fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if predict(T, mid) <= budget else (mid + 1, hi)
        return lo

    def layers(T: int) -> int:
        step = max(1, 1 << max(0, T.bit_length() - 5))  # 16 buckets per power of two
        return bucket(-(-T // step) * step)

    return layers


class AutoLayers:
    """``layers = "auto"``: T -> the number of layers `fitting_layers` picks for the learner's model ``config`` (a
    row's tokens per rank as T; ``memory``: the other arguments of ``model.memory.learner_memory``) under
    ``fraction`` of ``device``'s memory (host RAM on CPU). ``accumulating``, set by the learner before each
    micro-batch's forward and kept through its backward (a recompute decides as its forward did): whether the
    gradients of earlier micro-batches are held beside this one's activations."""

    def __init__(self, config: Any, device: torch.device, fraction: float, **memory: Any):
        from model.memory import learner_memory

        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            import psutil

            total = psutil.virtual_memory().total
        self.accumulating = True
        self._pick = {held: fitting_layers(lambda T, k, held=held: learner_memory(
            config, T, recompute_layers=k, accumulating=held, **memory)["total"], config.num_hidden_layers,
            int(fraction * total)) for held in (False, True)}

    def __call__(self, T: int) -> int:
        return self._pick[self.accumulating](T)


def install(module: torch.nn.Module, min_tokens: int, layers: Layers = None) -> int:
    """Checkpoint only rows of at least ``min_tokens`` tokens, and on them only the first ``layers`` decoder
    layers (None: all), in every checkpointing submodule; returns how many were wrapped. Install it after
    ``offload.install``, so it wraps the offload: a half it runs plainly must not be offloaded (its inputs are
    saved by autograd for the backward, with no recompute to bring them back)."""
    return wrap_checkpoint_fn(module, lambda fn: checkpoint_selected(fn, min_tokens, layers))
