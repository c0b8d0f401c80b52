"""The DeepSpeed learner on the tiny random Qwen3 (CPU, gloo): packing, logprobs, updates, checkpoints."""

import pytest
import torch

from configs.schema import LearnerSection, LossSection, OptimizerSection
from learner.engine import Learner, load_causal_lm
from learner.packing import Sample, make_micro_batches, plan_micro_batches


def _samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = 6 + 3 * i
        ids = torch.randint(10, 500, (L,), generator=g).tolist()
        mask = [0] * 3 + [1] * (L - 3)
        out.append(Sample(ids, mask, [0.0] * 3 + [-1.0] * (L - 3), advantage=float(i % 2) - 0.5))
    return out


def test_plan_respects_budget_and_is_deterministic():
    lengths = [5, 9, 3, 7, 2, 20]
    plan = plan_micro_batches(lengths, 10)
    assert sorted(i for b in plan for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 or len(b) == 1 for b in plan)
    assert plan == plan_micro_batches(lengths, 10)


def test_packed_row_layout():
    s = _samples(2)
    (mb,) = make_micro_batches(s, 1000, packed=True)
    n0, n1 = len(s[0].token_ids), len(s[1].token_ids)
    assert mb.cu_seqlens.tolist() == [0, n0, n0 + n1]
    assert mb.position_ids[0, n0].item() == 0
    assert mb.targets[0, 0].item() == s[0].token_ids[1]
    assert mb.loss_mask[0, n0 - 1].item() == 0  # the segment's last position predicts nothing
    assert mb.loss_mask.sum().item() == sum(sum(x.loss_mask[1:]) for x in s)


@pytest.fixture(scope="module")
def learner(tiny_qwen3_dir):
    return Learner(tiny_qwen3_dir, LearnerSection(micro_batch_tokens=24), seed=0)


def test_packed_and_padded_logprobs_match_unpacked(learner, tiny_qwen3_dir):
    samples = _samples()
    assert not learner.packed  # Qwen3 has no varlen forward: padded by default; packing still works through
    padded = learner.sequence_logprobs(samples, all_positions=True)  # position_ids (HF detects the segments)
    learner.packed = True
    packed = learner.sequence_logprobs(samples, all_positions=True)
    learner.packed = False
    model = load_causal_lm(tiny_qwen3_dir).eval()
    for s, a, b in zip(samples, packed, padded):
        with torch.no_grad():
            logits = model(torch.tensor([s.token_ids])).logits[0]
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s.token_ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(a[1:]), ref, atol=1e-5)
        assert torch.allclose(torch.tensor(b[1:]), ref, atol=1e-5)


def test_rl_step_moves_logprobs_along_advantage(learner):
    samples = _samples()
    before = learner.sequence_logprobs(samples)
    for s, lp in zip(samples, before):
        s.logprobs = [lp[j] if s.loss_mask[j] else 0.0 for j in range(len(lp))]  # on-policy rollout logprobs
    stats = learner.train_rl(samples, lr=1e-3)
    assert stats["tokens"] == sum(sum(s.loss_mask[1:]) for s in samples)
    assert stats["masked_frac"] == 0.0
    after = learner.sequence_logprobs(samples)
    delta = [sum(a[j] - b[j] for j in range(len(a)) if s.loss_mask[j]) for s, a, b in zip(samples, after, before)]
    for s, d in zip(samples, delta):
        assert (d > 0) == (s.advantage > 0), (s.advantage, d)


def test_checkpoint_roundtrip_restores_weights_and_optimizer(learner, tmp_path):
    samples = _samples()
    learner.train_sft(samples, lr=1e-3)
    learner.save_checkpoint(tmp_path, {"step": 7})
    w0 = learner.get_weights()
    s1 = learner.train_sft(samples)
    w1 = learner.get_weights()
    assert learner.load_checkpoint(tmp_path)["step"] == 7
    assert all(torch.equal(w0[k], v) for k, v in learner.get_weights().items())
    s2 = learner.train_sft(samples)  # same optimizer state -> the identical step
    assert s2["loss"] == pytest.approx(s1["loss"], abs=0) and s2["grad_norm"] == pytest.approx(s1["grad_norm"], abs=0)
    assert all(torch.equal(w1[k], v) for k, v in learner.get_weights().items())


@pytest.mark.vllm
def test_logprobs_at_the_rollout_temperature_equal_the_rollouts(tiny_qwen3_dir, ray_local, rollout_worker):
    """vLLM samples from softmax(logits / T) and reports those logprobs; the learner must score the same."""
    from rollout.worker import GenRequest

    fresh = Learner(tiny_qwen3_dir, LearnerSection(micro_batch_tokens=256), seed=0)
    prompts = [[1, 462, 279, 430, 205], [5, 17, 42, 99, 7, 8]]
    reqs = [GenRequest(f"t{i}", p, max_new_tokens=16, temperature=0.7, seed=i) for i, p in enumerate(prompts)]
    results = ray_local.get(rollout_worker.generate.remote(reqs))
    samples = [Sample(p + r.token_ids, [0] * len(p) + [1] * len(r.token_ids), [0.0] * len(p) + r.logprobs)
               for p, r in zip(prompts, results)]
    at_t = fresh.sequence_logprobs(samples, temperature=0.7)
    at_1 = fresh.sequence_logprobs(samples)
    for s, lp, lp1 in zip(samples, at_t, at_1):
        served = torch.tensor(s.logprobs[-len(lp) + 1:])[torch.tensor(s.loss_mask[1:]) == 1]
        ours = torch.tensor(lp[1:])[torch.tensor(s.loss_mask[1:]) == 1]
        assert (ours - served).abs().max() < 1e-4  # fp32 both sides
        assert (torch.tensor(lp1[1:])[torch.tensor(s.loss_mask[1:]) == 1] - served).abs().max() > 1e-2  # T matters


@pytest.mark.parametrize("updates_per_step", [1, 2])
def test_fused_head_trains_like_the_checkpointed_head(tiny_qwen3_dir, updates_per_step):
    """learner.fused_head (head gradients computed in the forward) against the checkpointed head: the same stats
    and the same weights after RL updates (with PPO clipping, a KL reference, truncated IS) and an SFT step."""
    loss = LossSection(kl_coef=0.1, tis_cap=2.0, clip_low=0.1, clip_high=0.1)
    learners = {f: Learner(tiny_qwen3_dir, LearnerSection(micro_batch_tokens=24, fused_head=f, loss=loss,
                                                          updates_per_step=updates_per_step), seed=0)
                for f in (False, True)}
    assert learners[True].fused_head and not learners[False].fused_head
    samples = _samples()
    for s, lp in zip(samples, learners[False].sequence_logprobs(samples)):
        s.logprobs = [x - 0.1 * (j % 3) if m else 0.0 for j, (x, m) in enumerate(zip(lp, s.loss_mask))]  # off-policy
    stats = {}
    for f, learner in learners.items():
        learner.snapshot_reference()
        stats[f] = [learner.train_rl(samples, lr=1e-3), learner.train_rl(samples), learner.train_sft(samples)]
    for a, b in zip(stats[False], stats[True]):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    initial = Learner(tiny_qwen3_dir, LearnerSection(), seed=0).get_weights()
    want, got = learners[False].get_weights(), learners[True].get_weights()
    for k, w in want.items():
        # 5% of the learning rate (1e-3): Adam scales each update by 1 / sqrt(v), so on an embedding row whose
        # gradients are near zero the two heads' fp32 sums, added in different orders, differ by up to 2.2e-5
        # (2 CPU threads, torch 2.13)
        torch.testing.assert_close(got[k], w, rtol=0, atol=5e-5)
    assert sum(not torch.equal(w, initial[k]) for k, w in want.items()) > len(want) // 2  # trained


def test_fused_adamw_steps_like_foreach(tiny_qwen3_dir):
    """learner.optimizer.fused (torch's fused AdamW under DeepSpeed, the default) takes the same steps as the
    foreach AdamW it replaces: same statistics and weights after an RL update and an SFT step."""
    learners = {f: Learner(tiny_qwen3_dir, LearnerSection(micro_batch_tokens=24,
                                                          optimizer=OptimizerSection(fused=f, weight_decay=0.1)),
                           seed=0)
                for f in (False, True)}
    for f, learner in learners.items():
        assert all(g["fused"] is f for g in learner.engine.basic_optimizer.param_groups)
    samples = _samples()
    for s, lp in zip(samples, learners[False].sequence_logprobs(samples)):
        s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
    stats = {f: [learner.train_rl(samples, lr=1e-3), learner.train_sft(samples, lr=1e-3)]
             for f, learner in learners.items()}
    for a, b in zip(stats[False], stats[True]):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    want, got = learners[False].get_weights(), learners[True].get_weights()
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def test_grad_norm_is_reported_in_both_dtypes(tiny_qwen3_dir):
    """fp32 at ZeRO-0 (a bare torch AdamW: the learner takes the norm itself) and bf16 (DeepSpeed's wrapper takes
    it for clipping and reports it) report the same pre-clipping gradient norm, up to bf16's rounding."""
    norms = {}
    for dtype in ("float32", "bfloat16"):
        learner = Learner(tiny_qwen3_dir, LearnerSection(micro_batch_tokens=24, dtype=dtype), seed=0)
        assert hasattr(learner.engine.optimizer, "_global_grad_norm") is (dtype == "bfloat16")
        norms[dtype] = learner.train_sft(_samples(), lr=1e-3)["grad_norm"]
    assert norms["float32"] > 0 and norms["bfloat16"] == pytest.approx(norms["float32"], rel=0.03)
