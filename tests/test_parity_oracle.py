"""Step-0 rollout/learner mismatch oracle: a short multi-turn episode played by vLLM (the Marathon plugin, bf16,
exact linear decode, prefix caching on) and scored by the learner's logprob path must agree within the bound that
`marathon bench parity` measured (benchmarks/parity/results.md). A change that makes the server compute
something else than the learner (a cast order, a kernel path, a state precision) shows up here first."""

from __future__ import annotations

import pytest

# benchmarks/parity (hybrid LSLG, bf16, exact decode), episodes of 2K / 8K / 32K tokens: mean |dlogprob| 1.6e-3 /
# 1.8e-3 / 1.4e-3, max 2.2e-2 / 1.6e-2 / 3.4e-2. The bounds leave ~2x for a 48-token episode's sampling noise; the
# recurrent decode measured 4.7e-3 mean in bf16 and a broken replay state 8e-2 (both fail here).
MEAN_BOUND, MAX_BOUND = 4e-3, 7e-2


def test_step_metrics_report_the_mismatch():
    """Every RL step's metrics carry mean / max |pi_old - pi_rollout| over model tokens and the masked fraction."""
    import torch

    from configs.schema import LossSection
    from learner.engine import Learner, _accumulate
    from learner.losses import policy_loss

    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    rollout = torch.tensor([-1.1, -2.0, -4.0, 0.0])  # the last token is not the model's: never counted
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    stats = policy_loss(logp, logp, rollout, torch.ones(4), mask, LossSection(ratio_mask=(0.5, 2.0))).stats
    assert stats["mismatch"] == pytest.approx(1.1) and stats["mismatch_max"] == pytest.approx(1.0)
    assert stats["masked"] == 1  # exp(1.0) > 2
    sums: dict[str, float] = {}
    for s in (stats, {**stats, "mismatch_max": 0.3}):  # two micro-batches
        for k, v in {"loss": 0.0, "grad_norm": 1.0, **s}.items():
            _accumulate(sums, k, v)
    row = Learner._summarise(sums, 1)
    assert row["mismatch_mean"] == pytest.approx(2.2 / 6) and row["mismatch_max"] == pytest.approx(1.0)
    assert row["masked_frac"] == pytest.approx(2 / 6)


@pytest.fixture(scope="module")
def exact_bf16_engine(tiny_marathon_dir):
    from vllm import LLM

    llm = LLM(model=str(tiny_marathon_dir), dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0,
              enable_prefix_caching=True, hf_overrides={"linear_exact_decode": True})
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.vllm
def test_step0_mismatch_within_bench_bound(exact_bf16_engine, tiny_marathon_dir):
    import torch

    from marathon.commands.bench_parity import learner_logprobs, play_episode, summarise

    # 384 tokens: turns of 16 sampled tokens at positions 96, 192 and 368, tool outputs in between
    ids, mask, served = play_episode(exact_bf16_engine, 384, 3, 16, seed=0)
    (ref,) = learner_logprobs(tiny_marathon_dir, "bfloat16", [(ids, mask, served)])
    diffs = [abs(served[i] - ref[i]) for i, m in enumerate(mask) if m]
    stats = summarise(diffs)
    assert stats["tokens"] == 48
    assert stats["mean"] <= MEAN_BOUND and stats["max"] <= MAX_BOUND, stats
    assert torch.isfinite(torch.tensor(diffs)).all()
