"""``Learner``: a DeepSpeed engine over a causal LM (``MarathonForCausalLM`` or any HF causal LM).

Plain Python (usable in-process and in tests); the driver runs it as a Ray actor. DeepSpeed provides ZeRO, bf16,
AdamW, gradient clipping and gradient accumulation: one RL update is one DeepSpeed global batch whose
micro-batches are the packed rows of ``learner.packing`` (the accumulation count is set per update, since
episodes have variable lengths). Learner logprobs are computed on the rollout's exact token ids.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from configs.schema import LearnerSection, LossSection
from learner import data_parallel as dp
from learner import offload, recompute
from learner.compile import compile_token_local
from learner.dist import init_distributed
from learner.logprobs import fusable_head, token_logprobs, token_loss_and_logprobs
from learner.losses import policy_loss, policy_token_loss
from learner.optimizer import FlatAdamW
from learner.packing import MicroBatch, Sample, make_micro_batches

STAT_KEYS = ("tokens", "clipped", "masked", "ratio", "is_weight", "kl", "mismatch")


def _accumulate(sums: dict[str, float], key: str, v: float) -> None:
    """Token sums add up; ``*_max`` statistics (learner.losses) take the max."""
    sums[key] = max(sums.get(key, 0.0), v) if key.endswith("_max") else sums.get(key, 0.0) + v


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> torch.nn.Module:
    """An HF causal LM from a checkpoint dir, read in ``dtype`` (a bf16 learner never holds an fp32 copy of the
    weights; its fp32 master weights are DeepSpeed's) and moved to ``device``. Marathon's own model type is
    registered by importing ``model``."""
    import model  # noqa: F401  (registers "marathon" with the Auto classes)
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return module if device is None else module.to(device)


def learner_device() -> torch.device:
    """This rank's accelerator (DeepSpeed's, so CUDA ranks use their LOCAL_RANK device), or the CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return torch.device("cpu") if acc.device_name() == "cpu" else torch.device(acc.device_name(acc.current_device()))


def flat_adamw(cfg: LearnerSection, zero_stage: int) -> bool:
    """Whether the learner steps with its own ``FlatAdamW`` (bf16 at ZeRO-0, ``learner.optimizer.flat``)."""
    return cfg.optimizer.flat and cfg.dtype == "bfloat16" and zero_stage == 0


def ds_config(cfg: LearnerSection, zero_stage: int) -> dict[str, Any]:
    """DeepSpeed's config. Under `flat_adamw` the optimizer is a client one, and DeepSpeed's bf16 mode (which would
    wrap it) and clipping are off: the model is already bf16 and ``FlatAdamW`` keeps the master weights and clips;
    the data-parallel all-reduce stays in bf16, as in DeepSpeed's bf16 mode (off, it would reduce in fp32)."""
    opt = cfg.optimizer
    config = {
        "train_micro_batch_size_per_gpu": 1,  # one packed row (or one padded block of rows)
        "gradient_accumulation_steps": 1,  # reset per update by Learner._update
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
                       "torch_adam": True, "fused": opt.fused},
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if flat_adamw(cfg, zero_stage):
        del config["optimizer"]
        config.update(gradient_clipping=0.0, bf16={"enabled": False}, communication_data_type="bf16")
    return config


def client_optimizer(cfg: LearnerSection, zero_stage: int, params: list[torch.nn.Parameter]) -> FlatAdamW | None:
    """The optimizer handed to ``deepspeed.initialize``: ``FlatAdamW`` under `flat_adamw`, else None (DeepSpeed
    builds its own from ``ds_config``)."""
    if not flat_adamw(cfg, zero_stage):
        return None
    opt = cfg.optimizer
    return FlatAdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                     max_grad_norm=opt.grad_clip)


class Learner:
    """One learner rank. Alone it is the whole learner; in a group (``learner.group`` on Ray, or any launcher
    that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, see ``learner.dist``) every rank runs the same calls
    on the same arguments: each trains its data-parallel share of the samples (``learner.data_parallel``) and
    returns the group's statistics."""

    def __init__(self, model_dir: str | Path, cfg: LearnerSection, seed: int = 0, zero_stage: int | None = None,
                 gradient_checkpointing: bool | None = None, micro_batch_tokens: int | None = None,
                 context_parallel_size: int | None = None) -> None:
        import deepspeed

        torch.manual_seed(seed)
        self.layout = init_distributed(context_parallel_size or cfg.context_parallel_size)
        self.cfg = cfg
        self.micro_batch_tokens = micro_batch_tokens or cfg.micro_batch_tokens
        zero_stage = cfg.zero_stage if zero_stage is None else zero_stage
        self.device = learner_device()
        self.recompute_layers: recompute.Layers = None  # the layers a checkpointed row recomputes (k, or k(T))
        config = ds_config(cfg, zero_stage)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        if zero_stage == 3:  # built under deepspeed.zero.Init: no rank materialises the whole model
            module = dp.load_zero3_causal_lm(model_dir, dtype, config)
        else:
            module = load_causal_lm(model_dir, dtype, self.device)
        if cfg.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing:
            module.gradient_checkpointing_enable()
            if cfg.offload_activations_tokens:
                offload.install(module, cfg.offload_activations_tokens)
            # outermost: a half run without checkpointing must bypass the offload
            if cfg.recompute_min_tokens or cfg.recompute_layers is not None:
                per_row = cfg.recompute_min_tokens or cfg.recompute_layers == "auto"  # decided by each row's length
                if per_row and zero_stage == 3 and self.layout.dp_size > 1:
                    raise ValueError("learner.recompute_min_tokens / recompute_layers: auto with zero_stage 3 and "
                                     "data parallelism: replicas whose rows differ in length would recompute, and "
                                     "so gather, different layers (a fixed recompute_layers: K is allowed)")
                self.recompute_layers = cfg.recompute_layers
                if cfg.recompute_layers == "auto":  # the memory model: this rank's states, each row's activations
                    self.recompute_layers = recompute.AutoLayers(
                        module.config, self.device, cfg.recompute_memory_fraction, zero_stage=zero_stage,
                        ranks=self.layout.world_size, bf16=dtype == torch.bfloat16, compiled=cfg.compile)
                recompute.install(module, cfg.recompute_min_tokens, self.recompute_layers)
        if cfg.compile:
            compile_token_local(module)
        module.config.use_cache = False
        self.forward_kwargs = set(inspect.signature(module.forward).parameters)
        # Packing needs a varlen forward (cu_seqlens); a plain HF model would attend over the whole packed row
        # (T^2 work, masked), so it gets padded micro-batches instead.
        self.packed = cfg.packing and "cu_seqlens" in self.forward_kwargs
        self.pad_id = module.config.pad_token_id or 0
        params = [p for p in module.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=params, config=config,
            optimizer=client_optimizer(cfg, zero_stage, params),
        )
        self.engine.train()
        # the head computes its gradients in the forward (learner.logprobs.fused_head_loss); not over ZeRO-3's
        # partitioned weight, which only the head's own call gathers
        self.fused_head = cfg.fused_head and fusable_head(self.module.get_output_embeddings())
        self.reference: torch.nn.Module | None = None
        self.updates = 0
        # Context parallelism: the one seam (learner.context_parallel) that makes the unchanged model's token
        # mixers split each packed row over the replica's CP ranks
        self.cp = None
        if self.layout.cp_size > 1:
            if not self.packed:
                raise ValueError("context_parallel_size > 1 splits packed rows: it needs learner.packing and a model "
                                 "whose forward takes cu_seqlens (MarathonForCausalLM)")
            from learner.context_parallel import apply_context_parallel

            self.cp = apply_context_parallel(self.module, self.layout.cp_group)

    # -- forward ----------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def on_shard(self, mb: MicroBatch):
        """Context manager giving the micro-batch this rank computes on: ``mb`` itself, or under context
        parallelism its shard of the row with the mixers CP-aware (run the backward inside it too)."""
        return self.cp.sharded(mb, self.pad_id) if self.cp is not None else nullcontext(mb)

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """Packed (or padded) micro-batches of ``samples``, on this rank's device."""
        return [mb.to(self.device) for mb in make_micro_batches(samples, self.micro_batch_tokens, self.packed,
                                                                 self.pad_id)]

    def rank_micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """This rank's data-parallel share of ``samples`` as micro-batches (as many as every other rank's; segment
        indices into ``samples``), on this rank's device."""
        if self.layout.world_size == 1:
            return self.micro_batches(samples)
        return dp.rank_micro_batches(samples, self.layout, self.micro_batch_tokens, self.packed, self.pad_id,
                                     self.device)

    @torch.no_grad()
    def sequence_logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None, temperature: float = 1.0,
                          all_positions: bool = False) -> list[list[float]]:
        """Per sample, logprob under pi / temperature of each token given its prefix (index 0 gets 0.0), from the
        current weights (or from ``model``, e.g. the KL reference). Only the policy's own tokens (loss mask 1)
        are scored unless ``all_positions``; the others get 0.0."""
        out: dict[int, list[float]] = {}
        for mb in self.rank_micro_batches(samples):
            with self.on_shard(mb) as local:
                logp = token_logprobs(model or self.engine, local, self.forward_kwargs, temperature, all_positions,
                                      compiled=self.cfg.compile)
            if self.cp is not None:  # the shards' logprobs, in row order (the row padded to a multiple of CP)
                logp = self.cp.gather(logp)
            for i, row, start in mb.segments:
                n = len(samples[i].token_ids)
                out[i] = [0.0] + logp[row, start : start + n - 1].tolist()
        return dp.gather_per_sample(out, len(samples), self.layout)

    # -- updates ----------------------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as the KL reference (only when the loss uses KL)."""
        if self.cfg.loss.kl_coef > 0:
            if self.engine.zero_optimization_stage() == 3:  # partitioned parameters cannot be deep-copied
                raise NotImplementedError("a KL reference (loss.kl_coef > 0) needs zero_stage 0-2")
            self.reference = copy.deepcopy(self.module).eval().requires_grad_(False)

    def _update(self, mbs: list[MicroBatch], loss_fn, temperature: float = 1.0, token_loss_fn=None) -> dict[str, float]:
        """One optimizer step over all micro-batches; loss_fn(mb, logp) -> (loss_sum, stats) summed over tokens;
        logp is of pi / temperature. ``token_loss_fn(mb)``: the same loss as per-token terms
        (``learner.logprobs.TokenLoss``) or None; given one, the head computes its gradients in the forward
        (``learner.fused_head``) and loss_fn only reports the statistics."""
        total = dp.update_tokens(mbs, self.layout)  # loss tokens of the whole update, over all ranks
        # gradient accumulation over exactly these micro-batches (on every rank)
        self.engine.set_train_batch_size(len(mbs) * self.engine.dp_world_size)
        scale = dp.loss_scale(len(mbs), self.engine.dp_world_size, total)
        sums: dict[str, float] = {}
        grad_norm = None
        for k, mb in enumerate(mbs):
            if isinstance(self.recompute_layers, recompute.AutoLayers):  # the first forward runs without gradients
                self.recompute_layers.accumulating = k > 0
            with self.on_shard(mb) as local:  # under CP: this rank's shard; `total` counts the whole rows
                token_loss = token_loss_fn(local) if token_loss_fn is not None and self.fused_head else None
                if token_loss is not None:
                    loss_sum, logp = token_loss_and_logprobs(self.engine, local, self.forward_kwargs, token_loss,
                                                             temperature, compiled=self.cfg.compile)
                    stats = loss_fn(local, logp)[1]
                else:
                    logp = token_logprobs(self.engine, local, self.forward_kwargs, temperature,
                                          compiled=self.cfg.compile)
                    loss_sum, stats = loss_fn(local, logp)
                # DeepSpeed divides by the accumulation count and averages over ranks (CP ranks included: each
                # holds its shard's partial gradient); the result is the token mean of the whole update
                # (learner.data_parallel)
                self.engine.backward(loss_sum * scale)
            if k == len(mbs) - 1 and not hasattr(self.engine.optimizer, "_global_grad_norm"):
                # a bare torch optimizer (fp32 at ZeRO-0) reports no norm: taken here, on the params' grads;
                # DeepSpeed's wrappers (bf16, ZeRO 1-3) and FlatAdamW compute it for clipping and report it after
                # the step
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters() if p.grad is not None])
            if k == len(mbs) - 1 and self.layout.world_size > 1:
                # MoE balancing statistics are all-reduced layer by layer: the same order on every rank
                getattr(self.module, "apply_router_updates", lambda: None)()
            self.engine.step()
            for key, v in {"loss": float(loss_sum.detach()), **stats}.items():
                _accumulate(sums, key, v)
        self.updates += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        sums = dp.sum_over_ranks(sums)  # every rank's token sums (ranks that trained nothing add zeros)
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        return sums

    def train_rl(self, samples: list[Sample], lr: float | None = None, temperature: float = 1.0) -> dict[str, float]:
        """``updates_per_step`` optimizer steps over ``samples`` (minibatches i::U); returns token-mean stats.
        ``temperature``: the rollout's sampling temperature; every logprob (pi, pi_old, reference) is of pi / T,
        the distribution the rollout logprobs are of."""
        if lr is not None:
            self.set_lr(lr)
        loss_cfg: LossSection = self.cfg.loss
        U = min(self.cfg.updates_per_step, len(samples))
        # pi_old; with one update it equals pi (detached)
        old = self.sequence_logprobs(samples, temperature=temperature) if U > 1 else None
        ref = self.sequence_logprobs(samples, self.reference, temperature) if self.reference is not None else None
        totals: dict[str, float] = {}
        for u in range(U):
            idx = list(range(u, len(samples), U))
            # pi_old and the reference laid out like each micro-batch's targets (so a CP shard cuts them too)
            mbs = [dataclasses.replace(mb, old_logprobs=self._gather(mb, old, idx) if old is not None else None,
                                       ref_logprobs=self._gather(mb, ref, idx) if ref is not None else None)
                   for mb in self.rank_micro_batches([samples[i] for i in idx])]

            def loss_fn(mb: MicroBatch, logp: torch.Tensor):
                old_lp = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
                out = policy_loss(logp, old_lp, mb.rollout_logprobs, mb.advantages, mb.loss_mask, loss_cfg,
                                  mb.ref_logprobs, segments=mb.segment_ids)
                return out.loss_sum, out.stats

            def token_loss_fn(mb: MicroBatch):
                return policy_token_loss(mb.old_logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask, loss_cfg,
                                         mb.ref_logprobs, segments=mb.segment_ids)

            for k, v in self._update(mbs, loss_fn, temperature, token_loss_fn).items():
                _accumulate(totals, k, v)
        return self._summarise(totals, U)

    def train_sft(self, samples: list[Sample], lr: float | None = None) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the model tokens of ``samples``."""
        if lr is not None:
            self.set_lr(lr)

        def loss_fn(mb: MicroBatch, logp: torch.Tensor):
            return -(logp * mb.loss_mask).sum(), {"tokens": float(mb.loss_mask.sum())}

        def token_loss_fn(mb: MicroBatch):
            mask = mb.loss_mask.reshape(-1).to(torch.float32)
            return lambda logp, rows: -logp * mask[rows]

        return self._summarise(self._update(self.rank_micro_batches(samples), loss_fn, token_loss_fn=token_loss_fn), 1)

    @staticmethod
    def _summarise(sums: dict[str, float], updates: int) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        out = {"loss": sums["loss"] / tokens, "grad_norm": sums["grad_norm"] / updates, "tokens": sums["tokens"]}
        for k in STAT_KEYS[1:]:
            if k in sums:
                out[{"clipped": "clip_frac", "masked": "masked_frac", "mismatch": "mismatch_mean"}.get(k, k)] = sums[k] / tokens
        out.update({k: v for k, v in sums.items() if k.endswith("_max")})
        return out

    @staticmethod
    def _gather(mb: MicroBatch, per_sample: list[list[float]], idx: list[int]) -> torch.Tensor:
        """Per-sample logprob lists (indexed like the full batch) laid out like ``mb``'s targets."""
        out = torch.zeros_like(mb.rollout_logprobs)
        for i, row, start in mb.segments:
            lp = per_sample[idx[i]]
            out[row, start : start + len(lp) - 1] = torch.tensor(lp[1:])
        return out

    # -- weights, checkpoints ---------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full model's tensors by HF name (gathered under ZeRO-3), fp32 on CPU, for the rollout workers."""
        import deepspeed

        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.engine.zero_optimization_stage() == 3):
            return {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}

    def router_stats(self) -> dict[str, float]:
        """Flat routing statistics when the model has MoE routers (``router_stats()``), else {}."""
        fn = getattr(self.module, "router_stats", None)
        if fn is None:
            return {}
        flat: dict[str, float] = {}
        for layer, stats in fn().items():
            for k, v in stats.items():
                if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
                    flat[f"router/layer{layer}/{k}"] = float(v)
        return flat

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        """Model, optimizer and learner RNG under ``path`` (DeepSpeed layout, tag "state"), written by every rank
        (ZeRO shards; ``path`` must be on a file system all ranks share) plus one small file per rank (its RNG and
        the group's layout). Resumed by a group of the same size and layout."""
        state = {**client_state, "learner_rng": torch.get_rng_state(), "updates": self.updates}
        self.engine.save_checkpoint(str(path), tag="state", client_state=state, save_latest=False)
        torch.save(dp.rank_state(self.layout, torch.get_rng_state(), type(self.engine.optimizer).__name__),
                   dp.rank_state_path(path, self.layout.rank))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        # refuses another group size / layout / optimizer before loading shards
        mine = dp.load_rank_state(path, self.layout, type(self.engine.optimizer).__name__)
        _, client_state = self.engine.load_checkpoint(str(path), tag="state")
        if client_state is None:
            raise FileNotFoundError(f"no learner checkpoint under {path}")
        rng = client_state.pop("learner_rng")
        torch.set_rng_state(mine["rng"] if mine is not None else rng)
        self.updates = client_state.pop("updates")
        return client_state

    def export_hf(self, path: str | Path, config_overrides: dict[str, Any] | None = None) -> str:
        """Save the current weights (in the learner's dtype) as an HF checkpoint (for evaluation, serving, or the
        next stage). Every rank calls it (ZeRO-3 gathers, bucket by bucket: no whole-model copy); rank 0 writes."""
        from learner.weight_sync import save_hf_streamed

        cfg = copy.deepcopy(self.module.config)
        for k, v in (config_overrides or {}).items():
            setattr(cfg, k, v)
        cfg.use_cache = True
        save_hf_streamed(self.module, path, cfg)
        return str(path)

    def stream_weights(self, workers: list[Any] | None, version: int, bucket_bytes: int | None = None,
                       dtype: str | None = None, measure_memory: bool = False) -> dict[str, Any]:
        """Send the weights to rollout worker actors in buckets (``learner.weight_sync``); every rank calls it,
        rank 0 with the workers. ``dtype`` defaults to the rollout's (``weight_sync_dtype``, "auto": the learner's)."""
        from learner.weight_sync import stream_to_workers

        if dtype is None or dtype == "auto":
            dtype = self.cfg.weight_sync_dtype if self.cfg.weight_sync_dtype != "auto" else self.cfg.dtype
        bucket_bytes = bucket_bytes or self.cfg.weight_sync_bucket_mb << 20
        return stream_to_workers(self.module, workers, version, bucket_bytes, dtype,
                                 measure_memory=measure_memory).as_dict()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters (its ZeRO-3 partitions) and optimizer state (master weights and
        moments, each storage once)."""
        return dp.state_bytes(self.module, self.optimizer)
