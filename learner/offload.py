"""Activation offload: the layer inputs that gradient checkpointing keeps for the backward, held in host memory.

With checkpointing, what a long row leaves on the GPU between its forward and its backward is the input of every
checkpointed half-layer, [1, T, D] each: at hidden 2048 in bf16 that is 8 KiB per token and layer, 96 GiB for one
1M-token episode of the 12-layer ``learner-bench`` preset, more than the model states and the largest layer's
recompute together. ``offload_checkpoint_inputs`` wraps the model's checkpoint function (the one seam; the model is
unchanged): each top-level tensor argument of at least ``min_tokens`` tokens is copied to (pinned) host memory once
the half-layer's forward has used it, its device storage released, and copied back just before that half's
recompute in the backward. The tensor object, its autograd identity and its gradient stay on the device; only its
storage travels, as DeepSpeed's ``cpu_checkpointing`` and its parameter offload move ``.data``. Cost: two copies of
T x D per half-layer over PCIe, on the compute stream (the host copy is pinned, so both are asynchronous for the host).

Attention-residual block tensors are passed inside a list and stay on the device: every later layer reads them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

HOST = torch.device("cpu")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    try:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    except RuntimeError:  # pinned memory exhausted: pageable (synchronous) copies still work
        host = torch.empty(t.shape, dtype=t.dtype)
    host.copy_(t.detach(), non_blocking=host.is_pinned())
    return host


def _is_row(a: Any) -> bool:
    """A row's hidden states [B, T, D]."""
    return torch.is_tensor(a) and a.dim() == 3


def row_tokens(args: tuple[Any, ...]) -> int:
    """T of a half-layer's row from its checkpointed arguments: the hidden-state input [B, T, D], or at an
    attention-residual block start (no stream yet) the first block of the list; 0 if neither is there."""
    for a in args:
        for t in a if isinstance(a, list) else [a]:
            if _is_row(t):
                return t.shape[1]
    return 0


def offload_checkpoint_inputs(checkpoint_fn: Callable[..., Any], min_tokens: int) -> Callable[..., Any]:
    """``checkpoint_fn`` (``torch.utils.checkpoint.checkpoint``-like, non-reentrant) with the storage of every
    device tensor argument [B, T, D] with T >= ``min_tokens`` held on the host between forward and recompute."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        big = [a for a in args if _is_row(a) and a.shape[1] >= min_tokens and a.device != HOST]
        if not big:
            return checkpoint_fn(fn, *args, **kwargs)
        device = big[0].device

        def on_device(*inner: Any) -> Any:  # the forward, then the recompute in backward
            for t in big:
                if t.device != device:
                    t.data = t.data.to(device, non_blocking=True)
            return fn(*inner)

        out = checkpoint_fn(on_device, *args, **kwargs)
        for t in big:
            t.data = _host_copy(t)
        return out

    return run


def wrap_checkpoint_fn(module: torch.nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> int:
    """Replace the checkpoint function of every submodule with gradient checkpointing enabled (HF's
    ``gradient_checkpointing_enable`` sets ``_gradient_checkpointing_func``) by ``wrap(it)``; returns how many."""
    n = 0
    for m in module.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) and fn is not None:
            m._gradient_checkpointing_func = wrap(fn)
            n += 1
    return n


def install(module: torch.nn.Module, min_tokens: int) -> int:
    """Offload the checkpointed inputs of rows of at least ``min_tokens`` tokens in every checkpointing submodule;
    returns how many were wrapped."""
    return wrap_checkpoint_fn(module, lambda fn: offload_checkpoint_inputs(fn, min_tokens))
