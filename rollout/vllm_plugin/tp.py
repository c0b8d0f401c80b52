"""Tensor parallelism for the Marathon vLLM plugin: which sizes divide the model, and per-rank weight slices.

The projections stay plain `nn.Linear` (see `model.py`) with LOCAL shapes; sharding happens at load time.
`load_weights` always receives FULL HF tensors (from the checkpoint, or streamed by the learner for an in-place
update), and each sharded parameter carries a `weight_loader` that copies this rank's slice. vLLM's in-place
reload keeps a parameter's attributes (it restores parameters from meta copies of them) and calls the same
loader, so updates under TP need nothing else.

Layout of the split (heads are contiguous blocks of rows in every HF projection of this model, so a head split
is a contiguous slice; there is no fused q|k|v or gate|up `nn.Linear` in the plugin, the routed experts' fused
gate_up is sliced per half by vLLM's own FusedMoE loader):
    column-parallel (dim 0): q/k/v, per-head gates (f_b, g_b, b, MLA g_proj), MLA q / kv_b, conv channels,
                             A_log / dt_bias, dense and shared-expert gate/up
    row-parallel (dim 1):    o_proj, dense and shared-expert down_proj, followed by an all-reduce
    replicated:              everything else (norms, router, residual mixes, low-rank f_a / g_a, MLA latent)
Sliding-window KV heads: split when TP divides them, replicated when their count divides TP (vLLM's rule for
GQA: rank r serves KV head r // (TP / kv_heads)).

This module imports no vLLM at import time: `marathon/plan.py` checks layouts with `tp_problem` before Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def tp_problem(config: Any, tp: int) -> str | None:
    """One message naming every config value a tensor-parallel size ``tp`` does not divide (None: it divides
    them all). Only the layer kinds and FFNs the layout has are checked."""
    if tp == 1:
        return None
    kinds = set(config.layer_kinds)
    bad = []

    def need(name: str, value: int) -> None:
        if value % tp:
            bad.append(f"{name}={value}")

    if "L" in kinds:
        need("linear_num_heads", config.linear_num_heads)
    if "S" in kinds:
        need("num_attention_heads", config.num_attention_heads)
        kv = config.num_key_value_heads
        if kv % tp and tp % kv:
            bad.append(f"num_key_value_heads={kv} (neither divides the other)")
    if "G" in kinds:
        need("mla_num_heads", config.mla_num_heads)
    if config.first_k_dense > 0:
        need("intermediate_size", config.intermediate_size)
    if config.first_k_dense < config.num_hidden_layers:
        need("moe_intermediate_size", config.moe_intermediate_size)
    if not bad:
        return None
    return (f"tensor_parallel_size={tp} does not divide the Marathon model's {', '.join(bad)}: "
            "the vLLM plugin splits heads and FFN widths evenly across TP ranks")


def check_tp(config: Any, tp: int) -> None:
    problem = tp_problem(config, tp)
    if problem:
        raise ValueError(problem)


def tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of the TP ranks' partial outputs (row-parallel layers); identity at TP 1."""
    if tp_size() == 1:
        return x
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x)


def kv_heads_local(kv_heads: int, tp: int) -> int:
    """KV heads on one rank: split when TP divides them, one replicated head otherwise."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def shard_loader(dim: int, replicas: int = 1) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A `weight_loader` (param, full HF tensor) that copies this rank's slice along ``dim``: the slice
    [(rank // replicas) * n, + n), n = param.shape[dim]. ``replicas`` ranks share one slice (replicated KV heads).
    The full tensor must hold exactly tp / replicas slices, so a wrong-shaped tensor fails loudly."""

    def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        n, tp = param.shape[dim], tp_size()
        if loaded_weight.shape[dim] * replicas != n * tp or loaded_weight.dim() != param.dim():
            raise ValueError(f"tensor of shape {tuple(loaded_weight.shape)} cannot be split along dim {dim} into "
                             f"{tp // replicas} slices of the served {tuple(param.shape)} (TP {tp})")
        piece = loaded_weight.narrow(dim, (tp_rank() // replicas) * n, n)
        param.data.copy_(piece)

    return weight_loader


def shard(module_or_param: torch.nn.Module | torch.Tensor, dim: int, replicas: int = 1) -> None:
    """Mark a parameter (or an nn.Linear / conv's ``weight``) as split along ``dim`` (a no-op at TP 1, so TP 1
    loads exactly as before)."""
    param = module_or_param.weight if isinstance(module_or_param, torch.nn.Module) else module_or_param
    if tp_size() > 1:
        param.weight_loader = shard_loader(dim, replicas)


def column(*modules_or_params) -> None:
    """Output rows split (dim 0): each rank computes its heads / its slice of the intermediate."""
    for m in modules_or_params:
        shard(m, 0)


def row(*modules) -> None:
    """Input columns split (dim 1): each rank's partial sum, to be all-reduced."""
    for m in modules:
        shard(m, 1)
