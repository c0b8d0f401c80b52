"""``Learner``: a DeepSpeed engine over a causal LM (``MarathonForCausalLM`` or any HF causal LM).

Plain Python (usable in-process and in tests); the driver runs it as a Ray actor. DeepSpeed provides ZeRO, bf16,
AdamW, gradient clipping and gradient accumulation: one RL update is one DeepSpeed global batch whose
micro-batches are the packed rows of ``learner.packing`` (the accumulation count is set per update, since
episodes have variable lengths). Learner logprobs are computed on the rollout's exact token ids.
"""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path
from typing import Any

import torch

from configs.schema import LearnerSection, LossSection
from learner.logprobs import token_logprobs
from learner.losses import policy_loss
from learner.packing import MicroBatch, Sample, make_micro_batches
from marathon.dist import init_single_process_group

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


def ds_config(cfg: LearnerSection, zero_stage: int) -> dict[str, Any]:
    opt = cfg.optimizer
    return {
        "train_micro_batch_size_per_gpu": 1,  # one packed row (or one padded block of rows)
        "gradient_accumulation_steps": 1,  # reset per update by Learner._update
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
                       "torch_adam": True},
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class Learner:
    def __init__(self, model_dir: str | Path, cfg: LearnerSection, seed: int = 0, zero_stage: int | None = None,
                 gradient_checkpointing: bool | None = None, micro_batch_tokens: int | None = None) -> None:
        import deepspeed

        torch.manual_seed(seed)
        init_single_process_group()
        self.cfg = cfg
        self.micro_batch_tokens = micro_batch_tokens or cfg.micro_batch_tokens
        zero_stage = cfg.zero_stage if zero_stage is None else zero_stage
        self.device = learner_device()
        module = load_causal_lm(model_dir, torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32, self.device)
        if cfg.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing:
            module.gradient_checkpointing_enable()
        module.config.use_cache = False
        self.forward_kwargs = set(inspect.signature(module.forward).parameters)
        # Packing needs a varlen forward (cu_seqlens); a plain HF model would attend over the whole packed row
        # (T^2 work, masked), so it gets padded micro-batches instead.
        self.packed = cfg.packing and "cu_seqlens" in self.forward_kwargs
        self.pad_id = module.config.pad_token_id or 0
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=ds_config(cfg, zero_stage),
        )
        self.engine.train()
        self.reference: torch.nn.Module | None = None
        self.updates = 0

    # -- forward ----------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """Packed (or padded) micro-batches of ``samples``, on this rank's device."""
        return [mb.to(self.device) for mb in make_micro_batches(samples, self.micro_batch_tokens, self.packed,
                                                                 self.pad_id)]

    @torch.no_grad()
    def sequence_logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None, temperature: float = 1.0,
                          all_positions: bool = False) -> list[list[float]]:
        """Per sample, logprob under pi / temperature of each token given its prefix (index 0 gets 0.0), from the
        current weights (or from ``model``, e.g. the KL reference). Only the policy's own tokens (loss mask 1)
        are scored unless ``all_positions``; the others get 0.0."""
        out: list[list[float]] = [[] for _ in samples]
        for mb in self.micro_batches(samples):
            logp = token_logprobs(model or self.engine, mb, self.forward_kwargs, temperature, all_positions)
            for i, row, start in mb.segments:
                n = len(samples[i].token_ids)
                out[i] = [0.0] + logp[row, start : start + n - 1].tolist()
        return out

    # -- updates ----------------------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as the KL reference (only when the loss uses KL)."""
        if self.cfg.loss.kl_coef > 0:
            self.reference = copy.deepcopy(self.module).eval().requires_grad_(False)

    def _update(self, mbs: list[MicroBatch], loss_fn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over all micro-batches; loss_fn(mb, logp) -> (loss_sum, stats) summed over tokens;
        logp is of pi / temperature."""
        total = sum(mb.num_loss_tokens for mb in mbs)
        self.engine.set_train_batch_size(len(mbs))  # gradient accumulation over exactly these micro-batches
        sums: dict[str, float] = {}
        grad_norm = None
        for k, mb in enumerate(mbs):
            logp = token_logprobs(self.engine, mb, self.forward_kwargs, temperature)
            loss_sum, stats = loss_fn(mb, logp)
            # DeepSpeed divides by the accumulation count; the result is the token mean of the whole update.
            self.engine.backward(loss_sum * len(mbs) / max(total, 1))
            if k == len(mbs) - 1 and self.engine.zero_optimization_stage() == 0:  # ZeRO-0 keeps grads on params
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters() if p.grad is not None])
            self.engine.step()
            for key, v in {"loss": float(loss_sum.detach()), **stats}.items():
                _accumulate(sums, key, v)
        self.updates += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
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
            mbs = self.micro_batches([samples[i] for i in idx])

            def loss_fn(mb: MicroBatch, logp: torch.Tensor, idx=idx):
                old_lp = self._gather(mb, old, idx) if old is not None else logp.detach()
                ref_lp = self._gather(mb, ref, idx) if ref is not None else None
                out = policy_loss(logp, old_lp, mb.rollout_logprobs, mb.advantages, mb.loss_mask, loss_cfg, ref_lp)
                return out.loss_sum, out.stats

            for k, v in self._update(mbs, loss_fn, temperature).items():
                _accumulate(totals, k, v)
        return self._summarise(totals, U)

    def train_sft(self, samples: list[Sample], lr: float | None = None) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the model tokens of ``samples``."""
        if lr is not None:
            self.set_lr(lr)

        def loss_fn(mb: MicroBatch, logp: torch.Tensor):
            return -(logp * mb.loss_mask).sum(), {"tokens": float(mb.loss_mask.sum())}

        return self._summarise(self._update(self.micro_batches(samples), loss_fn), 1)

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
        """Model, optimizer and learner RNG under ``path`` (DeepSpeed layout, tag "state")."""
        state = {**client_state, "learner_rng": torch.get_rng_state(), "updates": self.updates}
        self.engine.save_checkpoint(str(path), tag="state", client_state=state, save_latest=False)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(path), tag="state")
        if client_state is None:
            raise FileNotFoundError(f"no learner checkpoint under {path}")
        torch.set_rng_state(client_state.pop("learner_rng"))
        self.updates = client_state.pop("updates")
        return client_state

    def export_hf(self, path: str | Path, config_overrides: dict[str, Any] | None = None) -> str:
        """Save the current weights as an HF checkpoint (for evaluation, serving, or the next stage)."""
        module = self.module
        state = self.get_weights()
        cfg = copy.deepcopy(module.config)
        for k, v in (config_overrides or {}).items():
            setattr(cfg, k, v)
        cfg.use_cache = True
        module.save_pretrained(str(path), state_dict=state)
        cfg.save_pretrained(str(path))
        return str(path)
