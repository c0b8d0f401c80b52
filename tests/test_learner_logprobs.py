"""The learner's token-chunked logprob head (learner/logprobs.py) against the plain [T, vocab] path: same
logprobs and the same gradient for every parameter, at a sampling temperature, scoring only loss positions."""

from __future__ import annotations

import pytest
import torch

from learner.logprobs import forward_kwargs_for, fused_head_loss, token_logprobs, token_loss_and_logprobs
from learner.packing import Sample, make_micro_batches


def _tiny_marathon(seed=0):
    from model.config import MarathonConfig
    from model.modeling import MarathonForCausalLM

    torch.manual_seed(seed)
    # eval: no routing statistics are stashed (tests/test_model_moe.py covers them)
    return MarathonForCausalLM(MarathonConfig.from_preset("tiny")).float().eval()


def _micro_batch(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (37, 5, 90):
        ids = torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist()
        mask = [int(x) for x in (torch.rand(n, generator=g) < 0.6).tolist()]  # model tokens and tool outputs
        samples.append(Sample(ids, mask, [0.0] * n, advantage=1.0))
    (mb,) = make_micro_batches(samples, 10_000, packed=True)
    return mb


def _plain(model, mb, temperature):
    logits = model(**forward_kwargs_for(mb, {"cu_seqlens"})).logits.float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0] * (mb.loss_mask != 0)


def test_chunked_head_equals_plain_path_values_and_gradients(one_thread):
    model = _tiny_marathon()
    mb = _micro_batch(model)
    weights = torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        model.zero_grad()
        lp = fn()
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, g_ref = grads(lambda: _plain(model, mb, 0.7))
    out, g_out = grads(lambda: token_logprobs(model, mb, {"cu_seqlens"}, temperature=0.7, chunk_tokens=16))
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
    assert (out <= 0).all() and (out[mb.loss_mask == 0] == 0).all()
    assert g_out.keys() == g_ref.keys()
    for n, g in g_ref.items():
        assert torch.allclose(g_out[n], g, atol=1e-5, rtol=1e-5), n


def test_only_loss_positions_reach_the_head(one_thread):
    model = _tiny_marathon()
    mb = _micro_batch(model)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    with torch.no_grad():
        token_logprobs(model, mb, {"cu_seqlens"}, chunk_tokens=16)
    hook.remove()
    assert sum(rows) == int((mb.loss_mask != 0).sum()) < mb.loss_mask.numel()
    assert max(rows) <= 16


def test_fused_head_equals_the_checkpointed_head_values_and_gradients(one_thread):
    """The head that computes its gradients in the forward: the same loss, logprobs and parameter gradients as
    the checkpointed head followed by the loss, for a loss of per-token terms (here nonlinear in logp)."""
    model = _tiny_marathon()
    mb = _micro_batch(model)
    w = torch.randn(mb.loss_mask.numel(), generator=torch.Generator().manual_seed(4))

    def token_loss(logp, rows):
        return w[rows] * logp + 0.5 * torch.exp(logp)

    def grads(fn):
        model.zero_grad()
        loss, lp = fn()
        loss.backward()
        return loss.detach(), lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def checkpointed():
        lp = token_logprobs(model, mb, {"cu_seqlens"}, temperature=0.7, chunk_tokens=16)
        keep = (mb.loss_mask != 0).flatten()
        return token_loss(lp.flatten()[keep], keep.nonzero().squeeze(-1)).sum(), lp

    loss_ref, lp_ref, g_ref = grads(checkpointed)
    loss, lp, g = grads(lambda: token_loss_and_logprobs(model, mb, {"cu_seqlens"}, token_loss, 0.7, chunk_tokens=16))
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    assert torch.allclose(lp, lp_ref, atol=1e-6, rtol=0)
    assert g.keys() == g_ref.keys() and "lm_head.weight" in g
    for n, ref in g_ref.items():
        assert torch.allclose(g[n], ref, atol=1e-5, rtol=1e-5), n


def test_fused_head_refuses_a_head_it_cannot_take():
    hidden, targets = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="bias-free"):
        fused_head_loss(torch.nn.Linear(8, 16), hidden, targets, torch.arange(4), lambda lp, rows: lp)
