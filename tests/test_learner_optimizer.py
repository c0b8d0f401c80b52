"""``FlatAdamW`` (learner/optimizer.py): the bf16 learner's step at ZeRO-0, against DeepSpeed's wrapper around torch's
AdamW, which it replaces (CPU, gloo)."""

import pytest
import torch

from configs.schema import LearnerSection, OptimizerSection
from learner.engine import Learner
from learner.optimizer import FlatAdamW, _views
from tests.test_learner_engine import _samples


def _bf16_learner(model_dir, flat: bool, **opt) -> Learner:
    return Learner(model_dir, LearnerSection(micro_batch_tokens=24, dtype="bfloat16",
                                             optimizer=OptimizerSection(flat=flat, **opt)), seed=0)


def _reference_steps(params, grads_per_step, lr, wd, max_norm):
    """AdamW as written out: fp32 copies of the bf16 weights, each step's bf16 gradients in fp32, clipped by their
    global norm, torch's (unfused) AdamW from t = 1; the weights are the masters rounded to bf16."""
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    adam = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, foreach=False)
    for grads in grads_per_step:
        g = [torch.zeros_like(m) if x is None else x.float() for m, x in zip(masters, grads)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
        for m, x in zip(masters, g):
            m.grad = x * (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm else x
        adam.step()
    return masters


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e-3])  # 1e-3: every step clipped
def test_flat_adamw_is_adamw_on_fp32_masters(max_norm):
    """Three steps with weight decay, clipping and a parameter without a gradient (in one step) equal the written-out
    update (fp32 1e-6); the model's weights are always the bf16 rounding of the masters."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
    start = [p.detach().clone() for p in params]
    steps = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(3)]
    steps[1][1] = None
    opt = FlatAdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, max_grad_norm=max_norm)
    for grads in steps:
        for p, x in zip(params, grads):
            p.grad = x
        opt.step()
        assert not opt.overflow
    want = _reference_steps([torch.nn.Parameter(p) for p in start], steps, 1e-2, 0.1, max_norm)
    for m, w, p in zip(_views(opt.masters[0], params), want, params):
        torch.testing.assert_close(m, w.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), m.to(torch.bfloat16))


def test_the_bf16_learner_trains_through_flat_adamw(tiny_qwen3_dir):
    """bf16 at ZeRO-0: FlatAdamW instead of DeepSpeed's FP16_UnfusedOptimizer, with the same state bytes (bf16
    weights; fp32 masters and moments) and the same gradient norm on the same first gradients; it trains."""
    learners = {flat: _bf16_learner(tiny_qwen3_dir, flat, weight_decay=0.1) for flat in (False, True)}
    assert type(learners[True].engine.optimizer) is FlatAdamW
    assert type(learners[False].engine.optimizer).__name__ == "FP16_UnfusedOptimizer"
    flat, per_param = learners[True].state_bytes(), learners[False].state_bytes()
    assert flat["params"] == per_param["params"]
    n = len(list(learners[True].module.parameters()))
    assert flat["optimizer"] == per_param["optimizer"] - 4 * (n - 1)  # one fp32 step counter, not one per tensor
    samples = _samples()
    initial = learners[True].get_weights()
    first = {flat: lr.train_sft(samples, lr=1e-3) for flat, lr in learners.items()}
    assert first[True]["loss"] == first[False]["loss"]  # same weights before the first step
    assert first[True]["grad_norm"] == pytest.approx(first[False]["grad_norm"], rel=1e-3)
    learner = learners[True]
    for s, lp in zip(samples, learner.sequence_logprobs(samples)):
        s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
    losses = [learner.train_rl(samples)["loss"]] + [learner.train_sft(samples)["loss"] for _ in range(3)]
    assert losses[-1] < first[True]["loss"]
    weights = learner.get_weights()
    assert sum(not torch.equal(w, initial[k]) for k, w in weights.items()) > len(weights) // 2


def test_flat_adamw_checkpoint_resumes_the_identical_step(tiny_qwen3_dir, tmp_path):
    learner = _bf16_learner(tiny_qwen3_dir, True)
    samples = _samples()
    learner.train_sft(samples, lr=1e-3)
    learner.save_checkpoint(tmp_path, {"step": 1})
    masters = [m.clone() for m in learner.engine.optimizer.masters]
    s1, w1 = learner.train_sft(samples), learner.get_weights()
    fresh = _bf16_learner(tiny_qwen3_dir, True)
    assert fresh.load_checkpoint(tmp_path)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.engine.optimizer.masters, masters))
    s2 = fresh.train_sft(samples)
    assert s2["loss"] == s1["loss"] and s2["grad_norm"] == s1["grad_norm"]
    assert all(torch.equal(w1[k], v) for k, v in fresh.get_weights().items())
    with pytest.raises(ValueError, match="written by FlatAdamW, this learner steps with FP16_UnfusedOptimizer"):
        _bf16_learner(tiny_qwen3_dir, False).load_checkpoint(tmp_path)


def test_a_non_finite_gradient_skips_the_step():
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (5, 3))
    opt = FlatAdamW([a, b], lr=0.1, max_grad_norm=1.0)
    before = [a.detach().clone(), b.detach().clone()]
    a.grad = torch.ones_like(a)  # b has no gradient: it takes a zero one (weight decay 0: unchanged)
    opt.step()
    assert not opt.overflow and not torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert float(opt._global_grad_norm) == pytest.approx(5**0.5)
    moved = a.detach().clone()
    a.grad = torch.full_like(a, float("nan"))
    opt.step()
    assert opt.overflow and torch.equal(a, moved)
    assert int(opt.optimizer.state[opt.masters[0]]["step"]) == 1  # the skipped step is not counted


def _dp_rank(rank, model_dir):
    """One rank: an SFT step and an RL step in bf16 at ZeRO-0 (FlatAdamW), then its weights and masters."""
    torch.set_num_threads(1)
    learner = _bf16_learner(model_dir, True)
    samples = _samples(6)
    for s, lp in zip(samples, learner.sequence_logprobs(samples)):
        s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
    stats = [learner.train_sft(samples, lr=1e-3), learner.train_rl(samples, lr=1e-3)]
    return {"stats": stats, "weights": learner.get_weights(), "master": learner.engine.optimizer.masters[0].clone(),
            "comm_dtype": str(learner.engine.communication_data_type)}


def test_two_bf16_data_parallel_ranks_step_like_one(tiny_qwen3_dir):
    """DeepSpeed all-reduces the bf16 gradients in bf16 (its bf16 mode off under FlatAdamW); both replicas take the
    same step, which is one rank's step on all the episodes up to the bf16 rounding of the reduced gradients."""
    from learner.dist import spawn_ranks

    (one,) = spawn_ranks(_dp_rank, 1, str(tiny_qwen3_dir))
    assert one["comm_dtype"] == "torch.bfloat16"
    two = spawn_ranks(_dp_rank, 2, str(tiny_qwen3_dir))
    assert torch.equal(two[0]["master"], two[1]["master"])
    assert all(torch.equal(w, two[1]["weights"][k]) for k, w in two[0]["weights"].items())
    for s1, s2 in zip(one["stats"], two[0]["stats"]):
        assert s2["tokens"] == s1["tokens"]
        assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-2)
        assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=2e-2)
    # Adam's steps are about lr each, whatever the gradient's size: where a gradient is near zero, the two reductions'
    # roundings can flip its step (2.6e-3 at most, on 0.3% of the weights, 2 CPU threads, torch 2.13); a wrong
    # reduction would move most weights differently
    diff = (two[0]["master"] - one["master"]).abs()
    assert (diff > 1e-4).float().mean() < 0.01 and diff.max() <= 4e-3
