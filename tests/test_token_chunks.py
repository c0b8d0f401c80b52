"""Token chunks (model/chunking.py): with the chunk patched to 16 tokens, long rows run their token-local parts
chunk by chunk (recomputed in backward), KDA layers segment by segment with the state carried
(`LinearAttention._segmented`), MLA layers their heads in groups (`GatedMLA._head_groups`), and give the whole
row's logits and gradients."""

from __future__ import annotations

import pytest
import torch

import model.chunking as chunking
from model import MarathonConfig, MarathonForCausalLM
from model.attention import LinearAttention

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16
# lengths 31, 16, 17, 30, 16: sequences start at 31, 47 and 94, inside the 3-token conv halos of the chunks at 32,
# 48 and 96, and at 64, on a chunk boundary; T = 110 is not a multiple of the chunk
CU_SEQLENS = torch.tensor([0, 31, 47, 64, 94, 110])


def _model(**overrides) -> MarathonForCausalLM:
    torch.manual_seed(0)
    return MarathonForCausalLM(MarathonConfig.from_preset("tiny", **overrides)).train()


def _logits_and_grads(model, ids, chunk, monkeypatch, **kwargs):
    monkeypatch.setattr(chunking, "TOKEN_CHUNK", chunk)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, use_cache=False, **kwargs)
    w = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(1))
    (out.logits * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _assert_close(got, want, msg=None):
    """fp32 rounding: chunks sum a weight's gradient over their tokens in another order (and CPU GEMMs over other
    row counts round differently), so errors are judged against each tensor's largest entry."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=msg)


def _assert_same(chunked, whole):
    (logits, grads), (want_logits, want_grads) = chunked, whole
    _assert_close(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        _assert_close(g, want_grads[name], msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("gate,attn_residual,mla", [("bounded", True, {}), ("softplus", True, {}), ("bounded", False, {}),
                                                    ("bounded", True, {"mla_use_rope": True, "q_lora_rank": 32,
                                                                       "mla_num_heads": 5})])
def test_packed_row_in_chunks_matches_the_whole_row(checkpointing, gate, attn_residual, mla, monkeypatch):
    """A packed row of five sequences, every parameter's gradient, with and without gradient checkpointing, with
    attention residuals (the mixes and norms in chunks) and without (the norms alone), MLA with and without its
    rotary part and q low-rank path (5 heads: groups of 2, 2, 1); routing replayed from the whole-row run, so a
    near tie cannot flip an expert."""
    model = _model(linear_gate_fn=gate, attn_residual=attn_residual, **mla)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(1, 512, (1, int(CU_SEQLENS[-1])), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = model(input_ids=ids, cu_seqlens=CU_SEQLENS, use_cache=False, return_routed_experts=True).routed_experts
    whole = _logits_and_grads(model, ids, 1 << 20, monkeypatch, cu_seqlens=CU_SEQLENS, routed_experts=routed)
    chunked = _logits_and_grads(model, ids, CHUNK, monkeypatch, cu_seqlens=CU_SEQLENS, routed_experts=routed)
    _assert_same(chunked, whole)


def test_no_grad_forward_in_chunks_matches_the_whole_row(monkeypatch):
    model = _model().eval()
    ids = torch.randint(1, 512, (1, int(CU_SEQLENS[-1])), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, cu_seqlens=CU_SEQLENS, use_cache=False).logits
        monkeypatch.setattr(chunking, "TOKEN_CHUNK", CHUNK)
        got = model(input_ids=ids, cu_seqlens=CU_SEQLENS, use_cache=False).logits
    _assert_close(got, want)


def test_linear_layer_on_a_padded_batch_in_chunks(monkeypatch):
    """B = 2 unpacked rows (no pos_in_seg: the convs' zero history only reaches the dropped halo tokens), one
    left-padded (token_mask): output and gradients of the input and every parameter."""
    torch.manual_seed(0)
    layer = LinearAttention(MarathonConfig.from_preset("tiny"), 0)
    x = torch.randn(2, 75, layer.q_proj.in_features, requires_grad=True)
    mask = torch.ones(2, 75)
    mask[1, :9] = 0

    def run(chunk):
        monkeypatch.setattr(chunking, "TOKEN_CHUNK", chunk)
        out = layer(x, token_mask=mask)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])]

    whole = run(1 << 20)
    for a, b in zip(run(CHUNK), whole):
        _assert_close(a, b)


def test_linear_layer_segments_an_unpacked_row(monkeypatch):
    """B = 1, no cu_seqlens / pos_in_seg: the layer runs in segments (`_segmented`) and equals the whole row,
    output and the gradients of the input and every parameter (``.backward()``: the segments' parameter gradients
    accumulate into ``.grad`` during the backward, as under reentrant checkpointing)."""
    torch.manual_seed(0)
    layer = LinearAttention(MarathonConfig.from_preset("tiny"), 0)
    x = torch.randn(1, 75, layer.q_proj.in_features, requires_grad=True)
    calls = []
    segment = layer._segment
    monkeypatch.setattr(layer, "_segment", lambda *a, **k: calls.append(1) or segment(*a, **k))

    def run(chunk):
        monkeypatch.setattr(chunking, "TOKEN_CHUNK", chunk)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]

    whole = run(1 << 20)
    assert not calls
    for a, b in zip(run(CHUNK), whole):
        _assert_close(a, b)
    assert len(calls) == 2 * 5  # 5 segments, forward and the backward's recompute


def test_mla_head_groups_on_a_padded_batch(monkeypatch):
    """B = 2 rows, one left-padded (its key mask goes to every head group): GatedMLA with 4 heads run in groups of
    3 and 1 equals all heads at once, output and the gradients of the input and every parameter."""
    from model.attention import GatedMLA

    torch.manual_seed(0)
    layer = GatedMLA(MarathonConfig.from_preset("tiny", mla_num_heads=4), 0)
    x = torch.randn(2, 75, layer.o_proj.out_features, requires_grad=True)
    mask = torch.ones(2, 75)
    mask[1, :9] = 0
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)

    def run(chunk):
        monkeypatch.setattr(chunking, "TOKEN_CHUNK", chunk)
        out = layer(x, positions, attn_mask_2d=mask)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])]

    monkeypatch.setattr(chunking, "TOKEN_CHUNK", CHUNK)
    assert layer._heads_per_group(75) == 3
    whole = run(1 << 20)
    for a, b in zip(run(CHUNK), whole):
        _assert_close(a, b)


def test_short_rows_are_one_plain_call(monkeypatch):
    """T <= TOKEN_CHUNK: fn(*args) itself, no checkpoint, no copies."""
    x = torch.randn(1, CHUNK, 4)
    monkeypatch.setattr(chunking, "TOKEN_CHUNK", CHUNK)
    assert chunking.over_tokens(lambda t: t, x) is x
