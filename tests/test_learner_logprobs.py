"""The learner's token-chunked logprob head (learner/logprobs.py) against the plain [T, vocab] path: same
logprobs and the same gradient for every parameter, at a sampling temperature, scoring only loss positions."""

from __future__ import annotations

import torch

from learner.logprobs import forward_kwargs_for, token_logprobs
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
