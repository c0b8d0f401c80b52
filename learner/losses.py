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
where k3 = exp(ref - logp) - (ref - logp) - 1. The engine mismatch |pi_old - pi_rollout| (log space) is reported
per step: its sum and max over model tokens (``mismatch``, ``mismatch_max``) beside the masked count. Only model tokens (loss_mask == 1) count; the caller divides the
summed loss by the number of model tokens of the whole update (token-level mean, as in DAPO).

Async rollouts (decoupled PPO, as in AReaL): pi_rollout is each token's OWN behaviour logprob, from the policy
version that sampled it (an episode whose weights changed mid-way holds tokens of several versions), and pi_old
is the learner's current policy (the proximal policy). ``loss.is_level: segment`` truncates the importance
weight per behaviour segment (the tokens of one sample sampled by one version, ``MicroBatch.segment_ids``)
instead of per token: the segment's weight is the geometric mean of its tokens' pi_old / pi_rollout, capped at
``tis_cap``, and ``ratio_mask`` keeps or drops the whole segment on that mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
    stats: dict[str, float]  # sums over model tokens: clipped, masked, ratio, is_weight, kl, mismatch; "tokens";
    # and mismatch_max, a max over model tokens


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: LossSection, ref_logp: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> LossOutput:
    """All inputs are per token with the same shape (e.g. [T] of a packed row); mask is 1 on model tokens.
    ``segments`` (long, same shape, -1 off the mask): behaviour segment ids, used when ``cfg.is_level`` is
    "segment"."""
    mask = mask.to(logp.dtype)
    old_logp, rollout_logp = old_logp.detach(), rollout_logp.detach()
    behaviour_logp = rollout_logp  # each token's own, for the mismatch statistic
    if getattr(cfg, "is_level", "token") == "segment" and segments is not None:
        rollout_logp = _segment_mean_logratio(old_logp - rollout_logp, mask, segments, old_logp)
    t = _token_terms(logp, old_logp, rollout_logp, advantages, mask, cfg, ref_logp)
    with torch.no_grad():
        mismatch = (old_logp - behaviour_logp).abs() * mask  # |dlogprob| learner vs rollout, model tokens
        was_clipped = (t.ratio * advantages > t.clipped * advantages).to(mask.dtype)
        stats = {
            "tokens": float(mask.sum()),
            "clipped": float((was_clipped * mask).sum()),
            "masked": float((mask - t.keep).sum()),
            "ratio": float((t.ratio * mask).sum()),
            "is_weight": float((t.weight * mask).sum()),
            "kl": float((t.kl * mask).sum()),
            "mismatch": float(mismatch.sum()),
            "mismatch_max": float(mismatch.max()) if mismatch.numel() else 0.0,
        }
    return LossOutput((t.loss * mask).sum(), stats)


def policy_token_loss(old_logp: torch.Tensor | None, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, cfg: LossSection, ref_logp: torch.Tensor | None = None,
                      segments: torch.Tensor | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``policy_loss``'s loss as a sum of per-token terms, for a head that takes each token's gradient as soon as
    its logprob is known (``learner.logprobs.fused_head_loss``): (logp [n], rows [n], flat indices into the
    inputs) -> the rows' terms [n]; their sum over the mask's positions is ``policy_loss(...).loss_sum``.
    ``old_logp`` None: pi_old is pi, detached (one update per step). None where a term needs other tokens' logp
    (segment-level weights whose pi_old is pi)."""
    segment_level = getattr(cfg, "is_level", "token") == "segment" and segments is not None
    if segment_level and old_logp is None:
        return None
    mask = mask.to(rollout_logp.dtype)
    if segment_level:
        rollout_logp = _segment_mean_logratio(old_logp.detach() - rollout_logp.detach(), mask, segments,
                                              old_logp.detach())
    flat = [None if x is None else x.detach().reshape(-1) for x in (old_logp, rollout_logp, advantages, mask,
                                                                     ref_logp)]
    old, rollout, adv, m, ref = flat

    def token_loss(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        t = _token_terms(logp, logp.detach() if old is None else old[rows], rollout[rows], adv[rows], m[rows], cfg,
                         None if ref is None else ref[rows])
        return t.loss * m[rows]

    return token_loss


@dataclass
class _Terms:
    loss: torch.Tensor  # the token loss, before the mask
    ratio: torch.Tensor
    clipped: torch.Tensor
    weight: torch.Tensor  # truncated importance weight
    keep: torch.Tensor  # mask without the tokens ``ratio_mask`` drops
    kl: torch.Tensor


def _token_terms(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, cfg: LossSection, ref_logp: torch.Tensor | None) -> _Terms:
    """The module docstring's token loss, elementwise; old_logp and rollout_logp are detached."""
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
    return _Terms(token_loss, ratio, clipped, weight, keep, kl)


def _segment_mean_logratio(logratio: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor,
                           old_logp: torch.Tensor) -> torch.Tensor:
    """A stand-in for pi_rollout that makes every token's log(pi_old / pi_rollout) its segment's mean: the
    per-token weight and mask formulas then act per segment."""
    flat_seg, flat_lr, flat_m = segments.reshape(-1), logratio.reshape(-1), mask.reshape(-1)
    on = (flat_seg >= 0) & (flat_m > 0)
    idx = torch.where(on, flat_seg, torch.zeros_like(flat_seg))
    n = int(idx.max()) + 1 if bool(on.any()) else 1
    sums = torch.zeros(n, dtype=flat_lr.dtype, device=flat_lr.device).index_add_(0, idx, flat_lr * on)
    counts = torch.zeros(n, dtype=flat_lr.dtype, device=flat_lr.device).index_add_(0, idx, on.to(flat_lr.dtype))
    mean = (sums / counts.clamp(min=1))[idx]
    seg_lr = torch.where(on, mean, flat_lr).reshape(logratio.shape)
    return old_logp - seg_lr
