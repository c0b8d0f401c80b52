"""MoE routing: quantile balancing (both modes) against none on skewed inputs, no auxiliary loss, routing
replay, router statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import MarathonConfig, MarathonForCausalLM
from model.moe import MoE, Router

pytestmark = pytest.mark.usefixtures("one_thread")


def skewed_batches(steps: int, n: int = 512, d: int = 32, seed: int = 0):
    """Token features with a strong shared direction: an unbalanced router sends most tokens to a few experts."""
    common = torch.randn(d, generator=torch.Generator().manual_seed(1234)) * 3
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g) + common for _ in range(steps)]


def load_after_training(mode: str) -> tuple[float, int]:
    cfg = MarathonConfig.from_preset("tiny", hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, router_balance_mode=mode)
    torch.manual_seed(0)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.1)
    router.train()
    for x in skewed_batches(60):
        router.apply_pending()
        router(x)
    router.apply_pending()
    router.eval()
    _, idx = router(skewed_batches(1, n=4096, seed=1)[0])
    counts = torch.bincount(idx.flatten(), minlength=32).float()
    return float(counts.max() / counts.mean()), int((counts == 0).sum())


def test_quantile_balancing_flattens_a_skewed_load():
    none_ratio, none_dead = load_after_training("none")
    assert none_ratio > 4 and none_dead >= 8  # the skew is real
    for mode in ("quantile", "bias"):
        ratio, dead = load_after_training(mode)
        assert ratio < none_ratio / 2, (mode, ratio, none_ratio)
        assert dead <= none_dead // 4, (mode, dead, none_dead)


def test_balancing_changes_selection_only_and_adds_no_loss_term():
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", router_balance_mode="bias")).train()
    ids = torch.randint(0, 512, (2, 16))
    for _ in range(3):  # balancing state moves during training forwards
        model(ids, labels=ids)
    model(ids)  # applies the last stash
    router = model.model.layers[1].mlp.router
    assert router.expert_bias.abs().sum() > 0 and not router.expert_bias.requires_grad
    out = model(ids, labels=ids, return_routed_experts=True)
    plain_ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, plain_ce)  # the loss is the LM loss and nothing else
    # routing weights use the unbiased scores at the selected experts
    x = torch.randn(10, 128)
    w, idx = router(x)
    s = router.scores(x).gather(-1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * model.config.routed_scaling_factor)


def test_balancing_buffers_stay_fp32_in_a_bf16_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny")).to(torch.bfloat16)
    router = model.model.layers[1].mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.layers[1].mlp.router.load_ema.dtype == torch.float32


def test_eval_forwards_leave_balancing_state_alone():
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny")).eval()
    before = {k: v.clone() for k, v in model.state_dict().items() if "router" in k}
    ids = torch.randint(0, 512, (2, 16))
    model(ids)
    model(ids)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert "model.layers.1.mlp.router.expert_scale" in after and "model.layers.1.mlp.router.load_ema" in after


def test_routing_replay_reproduces_logits():
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, 512, (2, 16))
    rec = model(ids, return_routed_experts=True)
    for moe in model.model.moe_layers:  # what the learner sees later: the balancing state has moved on
        moe.router.expert_scale.copy_(torch.rand_like(moe.router.expert_scale) * 4)
    drifted = model(ids, return_routed_experts=True)
    assert not torch.equal(drifted.routed_experts, rec.routed_experts)
    replayed = model(ids, routed_experts=rec.routed_experts, return_routed_experts=True)
    assert torch.equal(replayed.routed_experts, rec.routed_experts)
    torch.testing.assert_close(replayed.logits, rec.logits, rtol=0, atol=0)
    as_list = model(ids, routed_experts=list(rec.routed_experts)).logits
    torch.testing.assert_close(as_list, rec.logits, rtol=0, atol=0)
    with pytest.raises(ValueError):
        model(ids, routed_experts=rec.routed_experts[:1])


def test_router_stats_report_load_and_dead_experts():
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny")).train()
    ids = torch.randint(0, 512, (1, 32))
    model(ids)
    model(ids)
    stats = model.router_stats()
    assert sorted(stats) == [1, 2, 3]
    for s in stats.values():
        assert s["tokens_per_expert"].sum() == 32 * 2
        assert s["max_over_mean"] >= 1.0 and 0 <= s["dead_experts"] < 8
        assert s["load_ema"].shape == (8,)


def test_grouped_expert_compute_matches_per_token_loop():
    cfg = MarathonConfig.from_preset("tiny")
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 9, 128)
    out, idx = moe(x)
    w, _ = moe.router(x[0], idx)
    ref = moe.shared_experts(x[0])
    for t in range(9):
        for j in range(2):
            e = idx[t, j]
            g, u = (x[0, t] @ moe.experts.gate_up_proj[e]).chunk(2)
            ref[t] = ref[t] + w[t, j] * (F.silu(g) * u) @ moe.experts.down_proj[e]
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


def test_long_rows_go_through_the_experts_in_recomputed_chunks(one_thread, monkeypatch):
    """Experts.TOKEN_CHUNK: chunked + checkpointed expert compute equals the whole row, values and gradients."""
    from model.moe import Experts

    torch.manual_seed(0)
    moe = MoE(MarathonConfig.from_preset("tiny")).double().eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 300, moe.experts.gate_up_proj.shape[1], dtype=torch.float64, requires_grad=True)

    def run():
        out, _ = moe(x)
        return [out, *torch.autograd.grad(out.square().sum(), [x, *moe.experts.parameters()])]

    whole = run()
    monkeypatch.setattr(Experts, "TOKEN_CHUNK", 64)
    for a, b in zip(run(), whole):
        assert torch.allclose(a, b, atol=1e-12)
