"""Losses against hand-computed values: group advantages, PPO clipping, truncated IS, masking, KL."""

import math

import pytest
import torch

from configs.schema import LossSection
from learner.losses import group_advantages, policy_loss, policy_token_loss


def test_grpo_advantages_known_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # two groups of 4
    adv = group_advantages(r, 4, "grpo")
    # group 1: mean 0.5, unbiased std = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expect = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expect, rel=1e-5)
    assert group_advantages(r, 4, "grpo", scale_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_rloo_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0])
    adv = group_advantages(r, 4, "rloo")
    # r_i - mean of the other three
    expect = [1 - 1.0, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3]
    assert adv.tolist() == pytest.approx(expect, rel=1e-6)


def test_advantage_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="unknown advantage"):
        group_advantages(torch.zeros(4), 2, "ppo")


def _cfg(**kw):
    base = dict(clip_low=0.2, clip_high=0.2, tis_cap=None, ratio_mask=None, kl_coef=0.0)
    return LossSection(**{**base, **kw})


def test_on_policy_gradient_is_minus_advantage_times_score():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([2.0, 2.0, -1.0])
    out = policy_loss(logp, logp.detach(), logp.detach(), adv, torch.ones(3), _cfg())
    out.loss_sum.backward()
    # ratio = 1: loss = -sum(A * ratio); d/dlogp = -A
    assert out.loss_sum.item() == pytest.approx(-(2 + 2 - 1))
    assert logp.grad.tolist() == pytest.approx([-2.0, -2.0, 1.0])


def test_clipping_zeroes_gradient_outside_the_trust_region():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.75, 0.75, 0.25, 0.25])).requires_grad_()  # ratios 1.5, 1.5, 0.5, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = policy_loss(new, old, old, adv, torch.ones(4), _cfg())
    out.loss_sum.backward()
    # A>0, r=1.5 > 1.2: clipped (value 1.2, no grad). A<0, r=1.5: unclipped term -1.5 is the min -> grad.
    # A>0, r=0.5: min(0.5, 0.8) = 0.5 unclipped -> grad. A<0, r=0.5: min(-0.5, -0.8) = -0.8 clipped -> no grad.
    assert out.loss_sum.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8))
    g = new.grad.tolist()
    assert g[0] == 0.0 and g[3] == 0.0
    assert g[1] == pytest.approx(1.5) and g[2] == pytest.approx(-0.5)  # d(-r*A)/dlogp = -r*A
    assert out.stats["clipped"] == 2


def test_masked_tokens_get_zero_gradient():
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    out = policy_loss(logp, logp.detach(), logp.detach(), torch.ones(3), torch.tensor([1.0, 0.0, 1.0]), _cfg())
    out.loss_sum.backward()
    assert logp.grad.tolist() == [-1.0, 0.0, -1.0]
    assert out.stats["tokens"] == 2


def test_truncated_importance_weight_and_ratio_mask():
    old = torch.tensor([0.0, 0.0, 0.0])
    rollout = torch.log(torch.tensor([1 / 3, 1 / 1.5, 1 / 10]))  # pi_old / pi_rollout = 3, 1.5, 10
    logp = old.clone().requires_grad_()
    adv = torch.ones(3)
    out = policy_loss(logp, old, rollout, adv, torch.ones(3), _cfg(tis_cap=2.0))
    out.loss_sum.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -1.5, -2.0])  # weights capped at 2
    logp.grad = None
    out = policy_loss(logp, old, rollout, adv, torch.ones(3), _cfg(tis_cap=2.0, ratio_mask=(0.5, 5.0)))
    out.loss_sum.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -1.5, 0.0])  # ratio 10 leaves [0.5, 5]: dropped
    assert out.stats["masked"] == 1


def test_kl_k3_value_and_gradient():
    ref = torch.tensor([-1.0, -1.0])
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    out = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(2), torch.ones(2), _cfg(kl_coef=0.5))
    assert out.loss_sum.item() == 0.0  # no reference given: no KL
    out = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(2), torch.ones(2), _cfg(kl_coef=0.5), ref)
    d = 1.0  # ref - logp on token 2
    assert out.loss_sum.item() == pytest.approx(0.5 * (math.exp(d) - d - 1))
    out.loss_sum.backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1
    assert logp.grad.tolist() == pytest.approx([0.0, 0.5 * (1 - math.exp(d))])


@pytest.mark.parametrize("case", ["on_policy", "old_given", "kl_tis_mask", "segments"])
def test_per_token_terms_sum_to_policy_loss_with_its_gradient(case):
    """policy_token_loss (the fused head's form of the loss): taken on any split of the positions, its terms sum
    to policy_loss's loss_sum with the same gradient."""
    g = torch.Generator().manual_seed(0)
    n = 40
    logp = (-torch.rand(n, generator=g) * 3).requires_grad_()
    rollout = logp.detach() + 0.3 * torch.randn(n, generator=g)
    old = None if case == "on_policy" else logp.detach() + 0.2 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) < 0.7).float()
    ref = logp.detach() + 0.1 * torch.randn(n, generator=g) if case == "kl_tis_mask" else None
    segments = torch.where(mask > 0, torch.arange(n) // 7, -1) if case == "segments" else None
    cfg = _cfg(**dict(kl_coef=0.3, tis_cap=1.5, ratio_mask=(0.6, 1.6)) if case == "kl_tis_mask" else {},
               **dict(is_level="segment", tis_cap=2.0) if case == "segments" else {})
    want = policy_loss(logp, logp.detach() if old is None else old, rollout, adv, mask, cfg, ref, segments).loss_sum
    (want_grad,) = torch.autograd.grad(want, logp)
    token_loss = policy_token_loss(old, rollout, adv, mask, cfg, ref, segments)
    rows = torch.randperm(n, generator=g)
    got = sum(token_loss(logp[r], r).sum() for r in rows.split(9))  # any split, any order
    (got_grad,) = torch.autograd.grad(got, logp)
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)


def test_segment_weights_with_pi_old_equal_pi_have_no_per_token_form():
    mask = torch.ones(4)
    assert policy_token_loss(None, torch.zeros(4), torch.ones(4), mask, _cfg(is_level="segment"),
                             segments=torch.zeros(4, dtype=torch.long)) is None
