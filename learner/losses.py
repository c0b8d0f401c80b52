"""Policy-gradient losses for sparse trajectory rewards.

Advantages are per trajectory and shared by all of its model tokens:
- GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), std unbiased (as in TRL); or only centred.
- RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r_group)).

Token loss, with three policies: pi (being trained), pi_old (the learner's policy before this RL step's updates,
i.e. the same weights the rollout used), pi_rollout (the logprobs the rollout engine reported):
  ratio  = pi / pi_old                                      PPO ratio, clipped to [1 - clip_low, 1 + clip_high]
  is_w   = min(pi_old / pi_rollout, tis_cap)                truncated importance weight (engine mismatch), no grad
  keep   = low <= pi_old / pi_rollout <= high               tokens outside ``ratio_mask`` are dropped
  loss_t = -min(ratio * A, clip(ratio) * A) * is_w * keep + kl_coef * k3(pi, pi_ref)
where k3 = exp(ref - logp) - (ref - logp) - 1. Only model tokens (loss_mask == 1) count; the caller divides the
summed loss by the number of model tokens of the whole update (token-level mean, as in DAPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs.schema import LossSection


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str = "grpo", scale_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] ordered group by group (N = groups * group_size) -> advantages [N]."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"need a 1-D reward vector whose length is a multiple of group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError("group_size must be >= 2 for a group baseline")
    r = rewards.float().view(-1, group_size)  # [groups, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if kind == "grpo":
        adv = centred / (r.std(dim=1, keepdim=True) + eps) if scale_std else centred
    elif kind == "rloo":
        adv = centred * group_size / (group_size - 1)
    else:
        raise ValueError(f"unknown advantage kind {kind!r}; expected 'grpo' or 'rloo'")
    return adv.view(-1)


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar: summed over kept model tokens (divide by the update's model-token count)
    stats: dict[str, float]  # sums over model tokens: clipped, masked, ratio, is_weight, kl; and "tokens"


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: LossSection, ref_logp: torch.Tensor | None = None) -> LossOutput:
    """All inputs are per token with the same shape (e.g. [T] of a packed row); mask is 1 on model tokens."""
    mask = mask.to(logp.dtype)
    old_logp, rollout_logp = old_logp.detach(), rollout_logp.detach()
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)  # pessimistic bound
    engine_ratio = torch.exp(old_logp - rollout_logp)
    weight = engine_ratio.clamp(max=cfg.tis_cap) if cfg.tis_cap is not None else torch.ones_like(engine_ratio)
    keep = mask
    if cfg.ratio_mask is not None:
        low, high = cfg.ratio_mask
        keep = mask * ((engine_ratio >= low) & (engine_ratio <= high)).to(mask.dtype)
    token_loss = -surrogate * weight * keep
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp.detach() - logp
        kl = torch.exp(d) - d - 1
        token_loss = token_loss + cfg.kl_coef * kl * mask
    with torch.no_grad():
        was_clipped = (ratio * advantages > clipped * advantages).to(mask.dtype)
        stats = {
            "tokens": float(mask.sum()),
            "clipped": float((was_clipped * mask).sum()),
            "masked": float((mask - keep).sum()),
            "ratio": float((ratio * mask).sum()),
            "is_weight": float((weight * mask).sum()),
            "kl": float((kl * mask).sum()),
        }
    return LossOutput((token_loss * mask).sum(), stats)
