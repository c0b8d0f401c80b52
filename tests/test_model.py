"""The hybrid model on CPU: shapes, save/load, cache == full forward per layer kind, HF generate, packed rows,
gradients, gate / attention-residual variants, gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from model import MarathonCache, MarathonConfig, MarathonForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**overrides) -> MarathonForCausalLM:
    torch.manual_seed(0)
    return MarathonForCausalLM(MarathonConfig.from_preset("tiny", **overrides)).eval()


def test_tiny_forward_shapes_and_loss():
    model = tiny()
    ids = torch.randint(0, 512, (2, 10))
    out = model(ids, labels=ids, return_routed_experts=True)
    assert out.logits.shape == (2, 10, 512)
    assert out.routed_experts.shape == (3, 20, 2)  # 3 MoE layers (first is dense), B*T tokens, top-2
    assert abs(out.loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5  # ~uniform at init
    assert 0.8e6 < model.num_parameters() < 2e6


def test_save_load_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny()
    model.model.layers[1].mlp.router.expert_bias.fill_(0.25)  # balancing state travels with the checkpoint
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "marathon"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MarathonForCausalLM)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 512, (1, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


LAYOUTS = {
    "linear": dict(layer_layout="L"),
    "sliding": dict(layer_layout="S", sliding_window=5),
    "global": dict(layer_layout="G"),
    "global-rope-qlora": dict(layer_layout="G", mla_use_rope=True, q_lora_rank=32),
    "mixed": dict(layer_layout="LSLG", sliding_window=5),
    "mixed-softplus-no-attnres": dict(layer_layout="LSLG", sliding_window=5, linear_gate_fn="softplus", attn_residual=False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_incremental_decoding_matches_full_forward(name):
    model = tiny(**LAYOUTS[name])
    ids = torch.randint(0, 512, (2, 14))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits  # [2, 14, V]
        cache = MarathonCache(model.config)
        chunks = [(0, 4), (4, 7)] + [(t, t + 1) for t in range(7, 14)]  # prefill, a chunk, then single steps
        for lo, hi in chunks:
            step = model(ids[:, lo:hi], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(step, full[:, lo:hi], rtol=1e-4, atol=1e-4, msg=f"tokens {lo}:{hi}")
    assert cache.get_seq_length() == 14


def test_generate_greedy_matches_manual_loop():
    model = tiny(sliding_window=6)
    prompt = torch.randint(0, 512, (1, 5))
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_generate_left_padded_batch_matches_single_rows():
    model = tiny(sliding_window=6)
    a, b = torch.randint(1, 512, (1, 7)), torch.randint(1, 512, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, prompt in ((0, a), (1, b)):
        single = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(out[row, -5:], single[0, -5:])


def test_right_padded_batch_matches_single_rows():
    model = tiny(sliding_window=4)
    a, b = torch.randint(0, 512, (1, 7)), torch.randint(0, 512, (1, 4))
    batch = torch.cat([a, torch.cat([b, torch.zeros(1, 3, dtype=torch.long)], dim=1)])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        logits = model(batch, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(logits[:1], model(a).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1:, :4], model(b).logits, rtol=1e-4, atol=1e-4)


def test_packed_rows_match_separate_sequences():
    model = tiny(sliding_window=4)
    lengths = [5, 3, 7]
    seqs = [torch.randint(0, 512, (1, n)) for n in lengths]
    cu = torch.tensor([0, 5, 8, 15])
    with torch.no_grad():
        packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu).logits
        separate = torch.cat([model(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)
    # the packed loss never predicts the first token of the next sequence
    labels = torch.cat(seqs, dim=1)
    loss = model(labels, cu_seqlens=cu, labels=labels).loss
    per_seq = [model(s, labels=s).loss * (len(s[0]) - 1) for s in seqs]
    torch.testing.assert_close(loss, sum(per_seq) / (15 - 3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_residual", [True, False])
@pytest.mark.parametrize("gate_fn", ["bounded", "softplus"])
def test_gradients_reach_every_parameter(attn_residual, gate_fn):
    model = tiny(attn_residual=attn_residual, linear_gate_fn=gate_fn).train()
    ids = torch.randint(0, 512, (2, 16))
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    decay = model.model.layers[0].self_attn.decay(torch.randn(1, 4, 128))
    assert decay.max() <= 0 and (gate_fn == "softplus" or decay.min() >= -5)


def test_attn_residual_changes_the_function_and_starts_uniform():
    ids = torch.randint(0, 512, (1, 8))
    on, off = tiny(attn_residual=True), tiny(attn_residual=False)
    assert not torch.allclose(on(ids).logits, off(ids).logits)
    assert all(p.abs().sum() == 0 for n, p in on.named_parameters() if n.endswith("res.query"))


def test_gradient_checkpointing_matches_plain_backward():
    ids = torch.randint(0, 512, (1, 12))
    grads = []
    for ckpt in (False, True):
        model = tiny().train()
        if ckpt:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_rope_theta_override_changes_sliding_layers_only_where_used(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny().save_pretrained(tmp_path)  # a context-extension stage reloads with a new base
    stage = AutoModelForCausalLM.from_pretrained(tmp_path, rope_theta=5e5)
    assert stage.model.layers[1].self_attn.rotary.theta == 5e5
    ids = torch.randint(0, 512, (1, 12))
    base = tiny(layer_layout="S", sliding_window=8)(ids).logits
    stretched = tiny(layer_layout="S", sliding_window=8, rope_theta=1e6)(ids).logits
    assert not torch.allclose(base, stretched)
    g_base = tiny(layer_layout="G")(ids).logits
    torch.testing.assert_close(tiny(layer_layout="G", rope_theta=1e6)(ids).logits, g_base)  # MLA without RoPE
