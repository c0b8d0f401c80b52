"""Data parallelism of the learner: which episodes each rank trains, and a loss normalised as on one rank.

Every rank receives the whole batch (one object-store copy on Ray) and takes its share: episodes are split over
the ``dp`` data-parallel replicas balanced by tokens (longest first onto the least-loaded replica; deterministic,
so every rank computes the same split without talking). A replica's ``cp`` context-parallel ranks share its
episodes. Each rank packs its share into micro-batches; all ranks then run the same number of micro-batches
(ZeRO-3 gathers parameters with collectives in every forward, and DeepSpeed reduces gradients at the same
boundary), the ranks with fewer padding with loss-free micro-batches.

Loss normalisation (the global token mean of one rank): DeepSpeed divides each micro-batch's loss by the
accumulation count ``A`` and averages gradients over its data-parallel world (all ``W = dp x cp`` ranks), so a
rank's backward takes ``loss_sum * A * W / N`` where ``N`` is the number of loss tokens of the whole update,
summed over the replicas. The result is ``sum over all ranks and micro-batches of grad(loss_sum) / N``: exactly
one rank's ``grad(sum of all token losses) / N``. Statistics (sums over tokens) are summed over all ranks, the
``*_max`` ones maximised.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from learner.dist import RankLayout
from learner.packing import MicroBatch, Sample, collate, make_micro_batches


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups of near-equal token sums (greedy longest-first onto the
    least-loaded group, ties to the lower index; each group in index order). Deterministic."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


def share(samples: list[Sample], layout: RankLayout) -> list[int]:
    """Indices of the samples this rank's data-parallel replica trains."""
    if layout.dp_size == 1:
        return list(range(len(samples)))
    return split_by_tokens([len(s.token_ids) for s in samples], layout.dp_size)[layout.dp_rank]


def empty_micro_batch(samples: list[Sample], packed: bool, pad_id: int = 0) -> MicroBatch:
    """A micro-batch that trains nothing (loss mask 0, no segments): a rank with fewer micro-batches runs it so
    that every rank takes part in the same collectives. Built from the batch's shortest sample (the same
    tensors as real ones, routed experts included)."""
    s = min(samples, key=lambda s: len(s.token_ids))
    n = len(s.token_ids)
    blank = Sample(list(s.token_ids), [0] * n, [0.0] * n, 0.0, s.routed_experts)
    return dataclasses.replace(collate([blank], [0], packed, pad_id), segments=[])


def max_over_ranks(n: int, group: Any = None) -> int:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def sum_over_ranks(values: dict[str, float], group: Any = None) -> dict[str, float]:
    """Each key summed over the ranks of ``group`` (None: the world), ``*_max`` keys maximised; every rank passes
    the same keys."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not values:
        return values
    out = dict(values)
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in values if not k.endswith("_max"))),
                     (dist.ReduceOp.MAX, sorted(k for k in values if k.endswith("_max")))):
        if keys:
            t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
            dist.all_reduce(t, op=op, group=group)
            out.update(zip(keys, t.tolist()))
    return out


def rank_micro_batches(samples: list[Sample], layout: RankLayout, budget: int, packed: bool, pad_id: int,
                       device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches of ``samples`` (segments index ``samples``), padded with empty micro-batches to
    the largest count of any rank, on ``device``."""
    mine = share(samples, layout)
    mbs = make_micro_batches([samples[i] for i in mine], budget, packed, pad_id) if mine else []
    for mb in mbs:  # segment indices: into ``samples``, not into this rank's share
        mb.segments = [(mine[i], row, start) for i, row, start in mb.segments]
    count = max_over_ranks(len(mbs))
    mbs += [empty_micro_batch(samples, packed, pad_id) for _ in range(count - len(mbs))]
    return [mb.to(device) for mb in mbs]


def update_tokens(mbs: list[MicroBatch], layout: RankLayout) -> int:
    """Loss tokens of the whole update: this replica's micro-batches summed over the replicas (each token counted
    once: the CP ranks of a replica share its micro-batches)."""
    n = sum(mb.num_loss_tokens for mb in mbs)
    return int(sum_over_ranks({"n": n}, layout.dp_group)["n"]) if layout.dp_size > 1 else n


def loss_scale(accumulation: int, world_size: int, tokens: int) -> float:
    """Factor on a micro-batch's summed loss so DeepSpeed's mean over accumulation steps and ranks gives the
    update's token mean (module doc)."""
    return accumulation * world_size / max(tokens, 1)


def gather_per_sample(local: dict[int, Any], count: int, layout: RankLayout) -> list[Any]:
    """Per-sample results computed by the replicas on their shares ({sample index: value}) -> the list of all
    ``count`` samples' values on every rank."""
    if layout.dp_size > 1:
        parts: list[dict[int, Any] | None] = [None] * layout.dp_size
        dist.all_gather_object(parts, local, group=layout.dp_group)
        local = {k: v for part in parts for k, v in (part or {}).items()}
    return [local[i] for i in range(count)]



# -- ZeRO-3 model construction ----------------------------------------------------------------------------------
def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no safetensors weights (model.safetensors or an index)")


def load_zero3_causal_lm(model_dir: str | Path, dtype: torch.dtype, ds_config: dict[str, Any]) -> torch.nn.Module:
    """An HF causal LM built under ``deepspeed.zero.Init``: each parameter is partitioned over the ranks as its
    module is constructed, so no rank ever holds the whole model. Rank 0 reads the parameters from the
    safetensors files one tensor at a time and each is broadcast into its partitions
    (``GatheredParameters(modifier_rank=0)``, one module's parameters at a time); buffers (not partitioned) are
    read by every rank. Peak per rank: its shards plus one module's full parameters."""
    import deepspeed
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    import model  # noqa: F401  (registers "marathon" with the Auto classes)

    model_dir = Path(model_dir)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    # dtype from the config (zero.Init's own dtype argument falls back to fp16/bf16 on some accelerators)
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():
        module = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        module.tie_weights()  # tied embeddings share one (partitioned) parameter, as from_pretrained ties them
    # zero.Init creates every floating tensor in the training dtype, buffers too: give each buffer the dtype the
    # model itself chooses (e.g. fp32 routing statistics in a bf16 model), read off a meta-device copy
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    meta_buffers = dict(shapes.named_buffers())
    for name, buf in list(module.named_buffers()):
        want = meta_buffers[name].dtype if name in meta_buffers else buf.dtype
        if buf.dtype != want:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = buf.to(want)
    del shapes
    rank = dist.get_rank() if dist.is_initialized() else 0
    files = _checkpoint_files(model_dir)
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})
    handles = {f: safe_open(str(f), framework="pt") for f in files}

    def read(name: str) -> torch.Tensor:
        return handles[where[name]].get_tensor(name)

    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    missing = []
    for sub in module.modules():
        params = [p for p in sub.parameters(recurse=False)]
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                for p in params:
                    names = [n for n in names_of[id(p)] if n in where]
                    if not names:
                        missing.append(names_of[id(p)][0])
                    elif rank == 0:
                        with torch.no_grad():
                            p.data.copy_(read(names[0]).to(p.dtype).view_as(p.data))
    for name, buf in module.named_buffers():
        if name in where:
            with torch.no_grad():
                buf.copy_(read(name).to(buf.dtype))
    if missing:
        raise KeyError(f"{model_dir}: no tensor for parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return module


# -- per-rank checkpoint state, memory accounting ---------------------------------------------------------------
def rank_state_path(path: str | Path, rank: int) -> Path:
    return Path(path) / f"learner_rank{rank:05d}.pt"


def rank_state(layout: RankLayout, rng: torch.Tensor, optimizer: str) -> dict[str, Any]:
    """``optimizer``: the class stepping the weights (its saved state converts to no other)."""
    return {"rank": layout.rank, "world_size": layout.world_size, "cp_size": layout.cp_size, "rng": rng,
            "optimizer": optimizer}


def load_rank_state(path: str | Path, layout: RankLayout, optimizer: str) -> dict[str, Any] | None:
    """This rank's saved state; refuses a checkpoint written by a group of another size or layout (a resume needs
    the same N: ZeRO shards are per rank), or by another optimizer class than ``optimizer``. None for a checkpoint
    from before per-rank files."""
    p = rank_state_path(path, layout.rank)
    if not p.is_file():
        if any(Path(path).glob("learner_rank*.pt")) or layout.world_size > 1:
            raise FileNotFoundError(f"{path}: no learner state for rank {layout.rank}; a checkpoint resumes with the "
                                    f"group size it was written by")
        return None
    state = torch.load(p, weights_only=False)
    if (state["world_size"], state["cp_size"]) != (layout.world_size, layout.cp_size):
        raise ValueError(f"{path}: written by {state['world_size']} learner ranks (CP {state['cp_size']}); this group "
                         f"has {layout.world_size} (CP {layout.cp_size}): resume with the same learner layout")
    if state.get("optimizer", optimizer) != optimizer:
        raise ValueError(f"{path}: optimizer state written by {state['optimizer']}, this learner steps with "
                         f"{optimizer} (learner.optimizer.flat, zero_stage, dtype): resume with the settings it was "
                         "written with")
    return state


def state_bytes(module: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """{"params", "optimizer"}: bytes of this rank's parameter storage (ZeRO-3: its partitions) and of the
    optimizer's own tensors (master weights, moments; storages shared with the parameters not counted)."""
    seen: set[int] = set()

    def add(t: torch.Tensor) -> int:
        if not torch.is_tensor(t) or t.numel() == 0:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    params = sum(add(p.ds_tensor if hasattr(p, "ds_tensor") else p.data) for p in module.parameters())
    inner = optimizer
    tensors: list[torch.Tensor] = []
    while inner is not None:
        for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "bit16_groups_flat",
                     "fp16_partitioned_groups_flat"):
            tensors += [t for t in getattr(inner, name, None) or [] if torch.is_tensor(t)]
        if isinstance(inner, torch.optim.Optimizer):
            for st in inner.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v)]
            tensors += [p for g in inner.param_groups for p in g["params"]]
        inner = getattr(inner, "optimizer", None)
    return {"params": params, "optimizer": sum(add(t) for t in tensors)}
