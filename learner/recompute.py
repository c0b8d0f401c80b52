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

The CP ranks of a row hold equal shards, so they decide alike (a recompute repeats the forward's collectives).
Data-parallel replicas train different rows: under ZeRO-3, which gathers the parameters again for each recompute,
the learner refuses it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from learner.offload import row_tokens, wrap_checkpoint_fn


def checkpoint_selected(checkpoint_fn: Callable[..., Any], min_tokens: int,
                        layers: int | None = None) -> Callable[..., Any]:
    """``checkpoint_fn`` (``torch.utils.checkpoint.checkpoint``-like) for rows [B, T, D] with T >= ``min_tokens``
    whose function's owner is one of the first ``layers`` owners seen (None: every one); ``fn(*args, **kwargs)``
    without checkpointing otherwise."""
    order: dict[Any, int] = {}  # owner (the decoder layer): its index in forward order, kept across forwards

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        index = order.setdefault(getattr(fn, "__self__", fn), len(order))
        if row_tokens(args) < min_tokens or (layers is not None and index >= layers):
            return fn(*args, **kwargs)
        return checkpoint_fn(fn, *args, **kwargs)

    return run


def install(module: torch.nn.Module, min_tokens: int, layers: int | None = None) -> int:
    """Checkpoint only rows of at least ``min_tokens`` tokens, and on them only the first ``layers`` decoder
    layers (None: all), in every checkpointing submodule; returns how many were wrapped. Install it after
    ``offload.install``, so it wraps the offload: a half it runs plainly must not be offloaded (its inputs are
    saved by autograd for the backward, with no recompute to bring them back)."""
    return wrap_checkpoint_fn(module, lambda fn: checkpoint_selected(fn, min_tokens, layers))
