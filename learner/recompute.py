"""Selective recompute: gradient checkpointing only for rows of at least ``learner.recompute_min_tokens`` tokens.

Full checkpointing runs every half-layer's forward twice (forward, then recompute in backward) to keep one [T, D]
input per half between the two. A short row's activations fit beside the model states: there the recompute only
costs time. ``checkpoint_long_rows`` wraps the model's checkpoint function (the seam ``learner/offload.py`` uses;
the model is unchanged): a half-layer whose row has fewer than ``min_tokens`` tokens (``offload.row_tokens``: under
context parallelism the rank's shard) runs plainly, its activations kept for the backward
(``model.memory.layer_activations``); longer rows are checkpointed as before.

The CP ranks of a row hold equal shards, so they decide alike (a recompute repeats the forward's collectives).
Data-parallel replicas train different rows: under ZeRO-3, which gathers the parameters again for each recompute,
the learner refuses it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from learner.offload import row_tokens, wrap_checkpoint_fn


def checkpoint_long_rows(checkpoint_fn: Callable[..., Any], min_tokens: int) -> Callable[..., Any]:
    """``checkpoint_fn`` (``torch.utils.checkpoint.checkpoint``-like) for rows [B, T, D] with T >= ``min_tokens``;
    ``fn(*args, **kwargs)`` without checkpointing for shorter rows."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if row_tokens(args) < min_tokens:
            return fn(*args, **kwargs)
        return checkpoint_fn(fn, *args, **kwargs)

    return run


def install(module: torch.nn.Module, min_tokens: int) -> int:
    """Checkpoint only rows of at least ``min_tokens`` tokens in every checkpointing submodule; returns how many
    were wrapped. Install it after ``offload.install``, so it wraps the offload: a row it runs plainly must not be
    offloaded (its inputs are saved by autograd for the backward, with no recompute to bring them back)."""
    return wrap_checkpoint_fn(module, lambda fn: checkpoint_long_rows(fn, min_tokens))
