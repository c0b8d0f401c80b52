"""MoE routing: quantile balancing (both modes) against none on skewed inputs, no auxiliary loss, routing
replay, router statistics; balancing state that moves only at optimizer steps (not in no-grad passes, not
between the micro-batches of an update, not twice under gradient checkpointing)."""

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
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(3):  # balancing state moves with each optimizer step
        model(ids, labels=ids).loss.backward()
        opt.step()
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
        assert s["tokens_per_expert"].sum() == 32 * 2 * 2  # both forwards of the update so far, top-2
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


def test_expert_gradients_through_the_sorted_gathers_match_the_per_token_loop():
    """`Experts`' dispatch and combine run their backward as gathers (`model.moe._Dispatch`, `kernels.gather_sum`): in
    fp64 the gradients of x, the routing weights and both weight banks equal those through a per-token loop, with
    several tokens on the same experts."""
    cfg = MarathonConfig.from_preset("tiny")
    torch.manual_seed(0)
    experts = MoE(cfg).experts.double()
    E, D = experts.gate_up_proj.shape[:2]
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    N, k = 7, 3
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    idx[:3] = idx[0]
    x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(N, k, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(N, D, dtype=torch.float64)
    params = [x, w, *experts.parameters()]
    got = torch.autograd.grad((experts(x, w, idx) * cot).sum(), params)
    ref = torch.stack([sum(w[t, j] * (F.silu(g) * u) @ experts.down_proj[idx[t, j]]
                           for j in range(k)
                           for g, u in [(x[t] @ experts.gate_up_proj[idx[t, j]]).chunk(2)]) for t in range(N)])
    want = torch.autograd.grad((ref * cot).sum(), params)
    for name, a, b in zip(["x", "weights", "gate_up_proj", "down_proj"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


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


def _router_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "router" in k and "weight" not in k}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("mode", ["quantile", "bias"])
def test_balancing_state_holds_still_inside_an_update(mode):
    """Old-policy logprobs (no grad, train mode), then micro-batches: every forward of the update routes with
    the same state, so the first micro-batch's logits equal the no-grad pass's; the optimizer step then moves
    the state once, from all micro-batches' statistics."""
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", router_balance_mode=mode)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the balancing state can change the logits
    mbs = [torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for ids in mbs:  # a first update, so that the state is not the init's
        model(ids, labels=ids).loss.backward()
    opt.step()
    start = _router_state(model)
    with torch.no_grad():
        old = [model(ids).logits for ids in mbs]  # pi_old
    assert _same(start, _router_state(model))
    for i, ids in enumerate(mbs):
        out = model(ids, labels=ids)
        torch.testing.assert_close(out.logits, old[i], rtol=0, atol=0)  # no drift between micro-batches
        out.loss.backward()
    assert _same(start, _router_state(model))
    routers = [m.router for m in model.model.moe_layers]
    stashed = [r.tokens_per_expert.clone() for r in routers]
    assert all(t.sum() == 3 * 24 * 2 for t in stashed)  # every micro-batch counted once
    opt.step()
    moved = _router_state(model)
    assert not _same(start, moved)
    buf = "expert_scale" if mode == "quantile" else "expert_bias"
    assert any(not torch.equal(start[k], moved[k]) for k in start if k.endswith(buf))  # selection moved
    assert all(not r._pending for r in routers)
    for r, t in zip(routers, stashed):  # the step folded in exactly the update's statistics
        assert torch.equal(r.tokens_per_expert, t)
    with torch.no_grad():
        new = model(mbs[0]).logits
    assert not torch.equal(new, old[0])  # and the next update routes with the new state


def test_no_grad_and_eval_passes_stash_nothing():
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny")).train()
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        model(ids)
    with torch.inference_mode():
        model(ids)
    model.eval()
    model(ids)
    assert all(not m.router._pending for m in model.model.moe_layers)
    before = _router_state(model)
    model.apply_router_updates()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert _same(before, _router_state(model))


def test_gradient_checkpointing_counts_each_forward_once():
    """The recompute in backward routes again: its statistics replace its forward's, they do not add.
    (Non-reentrant checkpointing, transformers' default: the reentrant kind cannot carry gradients through the
    attention-residual block lists.)"""
    cfg = MarathonConfig.from_preset("tiny", router_balance_mode="bias")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(3))
    states = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = MarathonForCausalLM(cfg).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        for _ in range(2):  # two micro-batches
            model(ids, labels=ids).loss.backward()
        assert all(m.router.tokens_per_expert.sum() == 2 * 40 * 2 for m in model.model.moe_layers)
        assert all(len(m.router._pending) == 2 for m in model.model.moe_layers)
        model.apply_router_updates()
        states.append(_router_state(model))
    assert _same(*states)
