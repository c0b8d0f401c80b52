"""The typed run configuration: a YAML file validated into pydantic models before any work starts.

``load_config(path)`` returns a ``RunConfig`` or raises ``ConfigError`` with one message naming the file, the key
and what was expected. Every section forbids unknown keys (a typo is an error, not a silently ignored setting).

A run is a list of stages (``RunConfig.resolved_stages()``): without a ``stages`` list it is one stage built from
the top-level settings; with one, each stage overrides a few of them (context length, RoPE base, batch, parallel
settings) and may carry a validation gate that must pass before the next stage starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration (or something it names: env id, reward file, model) is unusable; one clear message."""


class _Section(BaseModel):
    # NaN and inf are never meaningful settings (an lr of inf passes gt=0): refused like any malformed value
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _usable_path(value: str | None) -> str | None:
    """Paths the run reads or writes: not empty, no NUL (which no OS call accepts)."""
    if value is not None and (not value or "\x00" in value):
        raise ValueError(f"not a usable path: {value!r}")
    return value


UsablePath = Annotated[str, AfterValidator(_usable_path)]


class ModelSection(_Section):
    """Where the initial policy comes from."""

    source: Literal["tiny-qwen3", "marathon", "path"] = "tiny-qwen3"
    preset: str = "tiny"  # MarathonConfig preset, when source == "marathon"
    path: UsablePath | None = None  # an HF checkpoint directory (tokenizer files next to it), when source == "path"
    init_seed: int = 0  # random init of the tiny models
    vocab_size: int = Field(512, ge=64)  # tokenizer size of the tiny models (model/tokenizer.py)
    overrides: dict[str, Any] = Field(default_factory=dict)  # config fields, e.g. {num_hidden_layers: 2}

    @model_validator(mode="after")
    def _path_given(self) -> "ModelSection":
        if self.source == "path" and not self.path:
            raise ValueError("model.path is required when model.source is 'path'")
        return self


class EnvSection(_Section):
    id: str  # a gymnasium id, e.g. marathon/Arithmetic-v0
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to envs.make
    # Tool code of envs that run it (code sandbox, untrusted dataset tools/verifiers) runs behind a kernel
    # boundary (envs/sandbox.py); where it cannot be built the run refuses to start unless this is "weak":
    # a subprocess and an audit hook only, not a security boundary against the policy
    sandbox: Literal["kernel", "weak"] = "kernel"


class RolloutSection(_Section):
    num_workers: int = Field(1, ge=1)
    prompts_per_step: int = Field(8, ge=1)  # distinct tasks (seeds) per RL step
    group_size: int = Field(8, ge=2)  # episodes per task (GRPO/RLOO groups)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens_per_turn: int = Field(64, ge=1)
    max_episode_tokens: int = Field(512, ge=16)  # prompt + all turns; also vLLM's max_model_len
    kv_cache_gib: int = Field(1, ge=1)  # CPU KV cache
    prefix_caching: bool = True  # off makes rollouts independent of what earlier requests left in the cache
    # vLLM's per-step token budget. On CPU, seeded sampling fails when a prompt's prefill is chunked over steps
    # (vLLM rewinds the request's generator, which CPU generators cannot do): make it cover a whole batch.
    max_num_batched_tokens: int | None = Field(None, ge=16)
    # Marathon model: linear layers decode by replaying the chunk kernel from the last fp32 chunk-boundary state
    # (kernels/chunk_replay.py), so rollout logprobs equal the learner's; slower decode (benchmarks/parity)
    exact_linear_decode: bool = False
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    num_cpus_per_worker: float = Field(1.0, ge=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    # sync: each RL step rolls out its batch, then trains, then syncs weights (rollout and learner take turns).
    # async (marathon/async_loop.py): the workers run episodes continuously on vLLM's async engine while the
    # learner trains; new weights are loaded between engine steps and episodes in flight continue under them
    # (partial rollouts; every token keeps the version that sampled it and its behaviour logprob).
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)  # async: train on an episode only if its oldest token is <= this many versions old
    stale_episodes: Literal["drop", "rerun"] = "rerun"  # async: what happens to an episode older than that
    # Env faults are data (envs/guard.py): a reset/step past this limit, or one that raises, ends just its episode
    env_timeout_s: float | None = Field(60.0, gt=0)  # None: no limit
    # ...but a run whose every episode fails this many RL steps in a row stops (with the commonest failure)
    max_failed_steps: int = Field(3, ge=1)


class LossSection(_Section):
    """Policy-gradient loss on whole trajectories (``learner/losses.py``)."""

    advantage: Literal["grpo", "rloo"] = "grpo"
    grpo_scale_std: bool = True  # GRPO: divide the centred reward by the group's std
    clip_low: float = Field(0.2, ge=0, lt=1)  # PPO ratio clip [1 - clip_low, 1 + clip_high]
    clip_high: float = Field(0.28, ge=0)
    tis_cap: float | None = Field(2.0, gt=0)  # truncated importance weight min(pi_old / pi_rollout, cap)
    ratio_mask: tuple[float, float] | None = (0.5, 5.0)  # drop tokens whose pi_old / pi_rollout leaves this range
    kl_coef: float = Field(0.0, ge=0)  # k3 KL to a frozen reference (the policy at the start of RL)
    # truncated importance weight pi_old / pi_rollout per token, or per behaviour segment (the tokens of one
    # episode sampled by one policy version: geometric mean, capped and masked as a whole; learner/losses.py)
    is_level: Literal["token", "segment"] = "token"

    @model_validator(mode="after")
    def _mask_range(self) -> "LossSection":
        if self.ratio_mask is not None and not 0 < self.ratio_mask[0] < 1 < self.ratio_mask[1]:
            raise ValueError(f"ratio_mask must be (low, high) with 0 < low < 1 < high, got {self.ratio_mask}")
        return self


class OptimizerSection(_Section):
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables
    # torch's fused AdamW (CUDA and CPU): one fused multi-tensor pass over the fp32 master weights and both moments
    # per step, instead of foreach's chain of elementwise passes
    fused: bool = True
    # bf16 at ZeRO-0: the learner's FlatAdamW (learner/optimizer.py: fp32 master weights in one flat buffer, no
    # per-parameter host work, always fused) instead of DeepSpeed's per-parameter FP16_UnfusedOptimizer around
    # torch's AdamW
    flat: bool = True


class LearnerSection(_Section):
    zero_stage: Literal[0, 1, 2, 3] = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    loss: LossSection = Field(default_factory=LossSection)
    micro_batch_tokens: int = Field(4096, ge=16)  # token budget of one packed micro-batch
    packing: bool = True  # pack episodes into one row with cu_seqlens when the model has a varlen forward; else pad
    gradient_checkpointing: bool = False
    # torch.compile the model's token-local glue (norms, attention-residual mixes, short convs, gates, RoPE,
    # SwiGLU, routing, the logprob head's blocks: learner/compile.py); the first update pays the compiles
    compile: bool = False
    # the logprob head computes its gradients in its forward, beside the loss (3 head matmuls per block instead
    # of 4: learner/logprobs.py); zero_stage 3 keeps the checkpointed head (its weight is gathered per call)
    fused_head: bool = True
    # rows of at least this many tokens keep their checkpointed layer inputs in host memory (learner/offload.py)
    offload_activations_tokens: int | None = Field(None, ge=1)
    # with gradient checkpointing, rows of fewer tokens run their half-layers without it (activations kept, no
    # recompute in backward; learner/recompute.py); longer rows are checkpointed as before. 0: always checkpoint
    recompute_min_tokens: int = Field(0, ge=0)
    # on a checkpointed row, only the first this many decoder layers (forward order) are checkpointed; the later
    # ones keep their activations (learner/recompute.py). None: every layer; 0: none; "auto": per row, the fewest
    # whose predicted peak (model.memory) fits in recompute_memory_fraction of the device's memory
    recompute_layers: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    # "auto"'s share of the device's memory (the prediction was 4-5% over the H100's measured 64K peaks)
    recompute_memory_fraction: float = Field(0.95, gt=0, le=1)
    updates_per_step: int = Field(1, ge=1)  # optimizer steps per RL batch (>1: PPO clipping is active)
    # The learner group (learner/group.py): num_ranks DeepSpeed ranks = data parallel x context parallel
    num_ranks: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)  # ranks that split one packed row (must divide num_ranks)
    num_cpus: float = Field(1.0, ge=0)  # per rank
    num_gpus: float = Field(0.0, ge=0)  # per rank: one DeepSpeed rank drives at most one GPU
    # Weight sync to the rollout workers: buckets of about this many MiB, in the rollout's dtype ("auto": the
    # workers' dtype, bf16 for a bf16 learner), streamed from learner rank 0 (learner/weight_sync.py)
    weight_sync_bucket_mb: int = Field(256, ge=1)
    weight_sync_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # An actor that dies (learner, or a rollout worker during a weight sync): the driver restarts the actors from
    # the last checkpoint, at most this many times per driver process
    max_restarts: int = Field(2, ge=0)

    @model_validator(mode="after")
    def _compile_without_zero3(self) -> "LearnerSection":
        if self.compile and self.zero_stage == 3:
            raise ValueError("learner.compile is not supported with zero_stage 3 (parameters gathered by DeepSpeed's "
                             "hooks around compiled forwards are untested); use zero_stage 0-2 or compile: false")
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> "LearnerSection":
        if self.num_gpus > 1:
            raise ValueError(f"learner.num_gpus is per rank and a DeepSpeed rank drives one GPU (got {self.num_gpus}); "
                             "set learner.num_ranks for more GPUs")
        return self


class SFTSection(_Section):
    """Warm start on oracle demonstrations before RL (``steps: 0`` skips it)."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)
    num_demos: int = Field(256, ge=1)


class EvalSection(_Section):
    num_seeds: int = Field(64, ge=1)  # held-out seeds (envs.heldout_seeds)
    every: int = Field(0, ge=0)  # RL steps between evaluations; 0: only after SFT and at each stage end
    temperature: float = Field(0.0, ge=0)  # 0: greedy


class GateSection(_Section):
    """A check at a stage boundary: the next stage starts only if the metric is inside [min, max]."""

    metric: Literal["heldout_success", "reward_mean", "loss"] = "heldout_success"
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _bound_given(self) -> "GateSection":
        if self.min is None and self.max is None:
            raise ValueError("a gate needs min and/or max")
        return self


class ParallelSection(_Section):
    """Parallel settings a stage may change."""

    zero_stage: Literal[0, 1, 2, 3] | None = None
    num_learner_ranks: int | None = Field(None, ge=1)  # learner.num_ranks for this stage
    context_parallel_size: int | None = Field(None, ge=1)  # learner.context_parallel_size for this stage
    num_rollout_workers: int | None = Field(None, ge=1)
    rollout_tensor_parallel_size: int | None = Field(None, ge=1)
    gradient_checkpointing: bool | None = None
    micro_batch_tokens: int | None = Field(None, ge=16)


class StageSection(_Section):
    name: str
    steps: int = Field(ge=0)
    max_episode_tokens: int = Field(ge=16)
    rope_theta: float | None = Field(None, gt=0)  # RoPE base for this stage (None: keep the model's)
    prompts_per_step: int | None = Field(None, ge=1)
    group_size: int | None = Field(None, ge=2)
    max_new_tokens_per_turn: int | None = Field(None, ge=1)
    env_kwargs: dict[str, Any] = Field(default_factory=dict)  # merged over env.kwargs (e.g. haystack length)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    gate: GateSection | None = None


class RunConfig(_Section):
    seed: int = 0
    output_dir: UsablePath = "runs/tiny"
    rewards: UsablePath = "rewards/default.yaml"  # reward config file (relative: to the config file, then the package)
    steps: int = Field(0, ge=0)  # RL steps of the single stage when ``stages`` is empty
    checkpoint_every: int = Field(10, ge=1)
    model: ModelSection = Field(default_factory=ModelSection)
    env: EnvSection
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    stages: list[StageSection] = Field(default_factory=list)

    @model_validator(mode="after")
    def _stages(self) -> "RunConfig":
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        if self.stages and self.steps:
            raise ValueError("give either top-level 'steps' or a 'stages' list, not both")
        lengths = [s.max_episode_tokens for s in self.stages]
        if lengths != sorted(lengths):
            raise ValueError(f"stages must not shrink max_episode_tokens, got {lengths}")
        return self

    def resolved_stages(self) -> list["Stage"]:
        """The stages to run, in order, each with every setting filled in."""
        specs = self.stages or [StageSection(name="main", steps=self.steps, max_episode_tokens=self.rollout.max_episode_tokens)]
        out = []
        for s in specs:
            p = s.parallel
            out.append(
                Stage(
                    name=s.name,
                    steps=s.steps,
                    max_episode_tokens=s.max_episode_tokens,
                    rope_theta=s.rope_theta,
                    prompts_per_step=s.prompts_per_step or self.rollout.prompts_per_step,
                    group_size=s.group_size or self.rollout.group_size,
                    max_new_tokens_per_turn=s.max_new_tokens_per_turn or self.rollout.max_new_tokens_per_turn,
                    env_kwargs={**self.env.kwargs, **s.env_kwargs},
                    zero_stage=self.learner.zero_stage if p.zero_stage is None else p.zero_stage,
                    num_learner_ranks=p.num_learner_ranks or self.learner.num_ranks,
                    context_parallel_size=p.context_parallel_size or self.learner.context_parallel_size,
                    num_rollout_workers=p.num_rollout_workers or self.rollout.num_workers,
                    rollout_tensor_parallel_size=p.rollout_tensor_parallel_size or self.rollout.tensor_parallel_size,
                    gradient_checkpointing=(
                        self.learner.gradient_checkpointing if p.gradient_checkpointing is None else p.gradient_checkpointing
                    ),
                    micro_batch_tokens=p.micro_batch_tokens or self.learner.micro_batch_tokens,
                    gate=s.gate,
                )
            )
        return out


class Stage(_Section):
    """One stage with every setting resolved (see ``RunConfig.resolved_stages``)."""

    name: str
    steps: int
    max_episode_tokens: int
    rope_theta: float | None
    prompts_per_step: int
    group_size: int
    max_new_tokens_per_turn: int
    env_kwargs: dict[str, Any]
    zero_stage: int
    num_learner_ranks: int
    context_parallel_size: int
    num_rollout_workers: int
    rollout_tensor_parallel_size: int
    gradient_checkpointing: bool
    micro_batch_tokens: int
    gate: GateSection | None


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_config(data: Any, source: str = "<config>") -> RunConfig:
    """Validate already-loaded YAML data; ``source`` names it in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        more = f" (and {len(e.errors()) - 1} more problem(s))" if len(e.errors()) > 1 else ""
        got = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err["input"], dict) else ""
        raise ConfigError(f"{source}: {_where(err['loc'])}: {err['msg']}{got}{more}") from None


def resolve_config_path(path: str | Path) -> Path:
    """A config path as given, else relative to the installed ``configs`` package (``configs/tiny.yaml``)."""
    p = Path(path)
    if p.is_file():
        return p
    packaged = Path(__file__).parent / p.name
    if packaged.is_file() and p.parent.name in ("configs", ""):
        return packaged
    raise ConfigError(f"{path}: config file not found")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a YAML config. ``overrides`` maps dotted keys to values (``{"rollout.group_size": 4}``)."""
    p = resolve_config_path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}".replace("\n", " ")) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid YAML: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid YAML: nested too deeply") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e.strerror}") from None
    for key, value in (overrides or {}).items():
        node = data if isinstance(data, dict) else {}
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{p}: override {key}: {part} is not a section")
        node[last] = value
    return parse_config(data, str(p))
