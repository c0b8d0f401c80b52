"""Attention without [T, T] anything (model/attention/sdpa.py): the blocked sliding-window path, the
per-sequence packed path and (on CUDA) FlashAttention varlen equal an explicit dense-mask softmax attention, values
and gradients; the model's packed forward equals the dense-mask attention it replaced."""

from __future__ import annotations

import pytest
import torch

import model.attention.mla as mla_mod
import model.attention.sliding as sliding_mod
from model import MarathonConfig, MarathonForCausalLM
from model.attention import sdpa
from model.attention.sdpa import attend, attention_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def dense_reference(q, k, v, past=0, window=None, cu_seqlens=None):
    """Explicit softmax attention with a dense [T, S] mask (what the model computed before): query i at stream
    past + i, key j at past + T - S + j; packed rows see only their own sequence."""
    T, S = q.shape[2], k.shape[2]
    qi = torch.arange(past, past + T, device=q.device)[:, None]
    kj = torch.arange(past + T - S, past + T, device=q.device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= qi - kj < window
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device)
        seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=q.device), cu_seqlens.diff())
        allowed &= seg[:, None] == seg[None, :]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _qkv(T, S=None, Hq=4, Hkv=2, d=16, dv=None, B=1, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, Hq, T, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, dv or d, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def _check(fn, ref, inputs, tol):
    out, want = fn(*inputs), ref(*inputs)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    w = torch.randn_like(want)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    want_grads = torch.autograd.grad((want * w).sum(), inputs)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("T,window", [(1, 4), (7, 4), (300, 8), (300, 64), (300, 200), (300, 300), (300, 1000),
                                      (1000, 130), (257, None)])
def test_whole_sequence_attention_matches_dense_mask(T, window):
    _check(lambda q, k, v: attend(q, k, v, 0, window), lambda q, k, v: dense_reference(q, k, v, 0, window),
           _qkv(T), 1e-10)


@pytest.mark.parametrize("window", [None, 3, 16, 64, 500])
def test_packed_rows_match_dense_block_diagonal_mask(window):
    cu = torch.tensor([0, 1, 64, 65, 128, 129, 400, 410])  # lengths 1, 63, 1, 63, 1, 271, 10
    _check(lambda q, k, v: attend(q, k, v, 0, window, cu),
           lambda q, k, v: dense_reference(q, k, v, 0, window, cu), _qkv(410, d=24, dv=16), 1e-10)


@pytest.mark.parametrize("past,T,S,window", [(10, 300, 306, 7), (500, 300, 800, 64), (0, 200, 200, 17), (5, 3, 7, 5)])
def test_window_over_a_carried_prefix_matches_dense_mask(past, T, S, window):
    """Queries after `past` earlier tokens of which the last S - T are still keys (a cache or a CP halo)."""
    _check(lambda q, k, v: attend(q, k, v, past, window), lambda q, k, v: dense_reference(q, k, v, past, window),
           _qkv(T, S), 1e-10)


def test_fp32_matches_the_dense_mask_path_it_replaced():
    """fp32 at 1e-5 against SDPA with `attention_mask`'s dense [T, T] mask (the previous code path)."""
    q, k, v = _qkv(700, dtype=torch.float32)
    for window in (64, 100, None):
        mask = attention_mask(700, 700, 0, window)
        old = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               enable_gqa=True)
        torch.testing.assert_close(attend(q, k, v, 0, window), old, rtol=1e-5, atol=1e-5)


def test_no_block_mask_grows_with_the_sequence(monkeypatch):
    """The sliding-window path builds masks of one block's size, and only one per block geometry."""
    made = []
    real = sdpa._block_mask
    monkeypatch.setattr(sdpa, "_block_mask", lambda *a: made.append(a[:2]) or real(*a))
    q, k, v = _qkv(5000, d=8, dtype=torch.float32)
    with torch.no_grad():
        attend(q, k, v, 0, 64)
    assert len(made) <= 3  # first block, interior blocks, the last partial block
    assert max(nq * nk for nq, nk in made) <= 128 * (128 + 63)


# -- the model ----------------------------------------------------------------------------------------------------


def _dense_attend(q, k, v, past=0, window=None, cu_seqlens=None, key_mask=None):
    """The attention the model used before: one dense masked SDPA per packed sequence."""
    import torch.nn.functional as F

    if cu_seqlens is not None:
        b = cu_seqlens.tolist()
        return torch.cat([_dense_attend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], 0, window)
                          for lo, hi in zip(b[:-1], b[1:])], dim=2)
    mask = attention_mask(q.shape[2], k.shape[2], past, window, key_mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_model_packed_training_forward_matches_dense_mask_path(monkeypatch, checkpointing):
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", sliding_window=16, layer_layout="SGLS")).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 512, (1, 300))
    cu = torch.tensor([0, 37, 38, 200, 300])

    def run():
        model.zero_grad(set_to_none=True)
        for moe in model.model.moe_layers:
            moe.router.discard_pending()
        out = model(ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    new_logits, new_grads = run()
    monkeypatch.setattr(sliding_mod, "attend", _dense_attend)
    monkeypatch.setattr(mla_mod, "attend", _dense_attend)
    old_logits, old_grads = run()
    torch.testing.assert_close(new_logits, old_logits, rtol=1e-5, atol=1e-5)
    assert new_grads.keys() == old_grads.keys()
    for name, g in new_grads.items():
        torch.testing.assert_close(g, old_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_prefill_longer_than_the_window_then_decode_matches_full_forward():
    """The blocked path in a cached prefill (no past), then decode steps over the kept window - 1 keys."""
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", sliding_window=8, layer_layout="SG")).eval()
    ids = torch.randint(0, 512, (2, 300))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :290], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(290, 300):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# -- CUDA -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d,dv,window", [(64, 64, None), (64, 64, 33), (192, 128, None), (128, 128, 1000)])
def test_cuda_varlen_flash_matches_dense_reference(d, dv, window):
    """bf16 against the fp64 dense reference: sliding windows through FlashAttention varlen (when torch has it),
    global layers through SDPA per sequence."""
    cu = torch.tensor([0, 1, 63, 128, 1128, 5225])
    q, k, v = (x.detach().cuda() for x in _qkv(5225, d=d, dv=dv, Hq=8, Hkv=2))
    ref = dense_reference(q, k, v, 0, window, cu)
    w = torch.randn_like(ref)
    qb, kb, vb = (x.bfloat16().requires_grad_() for x in (q, k, v))
    assert sdpa._flash_varlen_ok(qb, kb, vb) == bool(sdpa._varlen_fn())
    out = attend(qb, kb, vb, 0, window, cu)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    grads = torch.autograd.grad((out.double() * w).sum(), [qb, kb, vb])
    q64, k64, v64 = (x.clone().requires_grad_() for x in (q, k, v))
    ref_grads = torch.autograd.grad((dense_reference(q64, k64, v64, 0, window, cu) * w).sum(), [q64, k64, v64])
    for a, b in zip(grads, ref_grads):
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < 2e-2, float(err)
    # fp32 on CUDA: the per-sequence SDPA / window-block path
    q32, k32, v32 = (x.float() for x in (q, k, v))
    torch.testing.assert_close(attend(q32, k32, v32, 0, window, cu).double(), ref, rtol=0, atol=1e-4)


def _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """FlashAttention varlen's contract on CPU (torch 2.12's signature): q [N, Hq, D], k/v [N, Hkv, D]; causal,
    key j visible from query i iff i - window_size[0] <= j <= i (left -1: unbounded) within each sequence of cu."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and window_size[1] == 0
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and enable_gqa == (q.shape[1] != k.shape[1])
    b = cu_q.tolist()
    assert max_q == max_k == max(y - x for x, y in zip(b[:-1], b[1:]))
    out = []
    for lo, hi in zip(b[:-1], b[1:]):
        qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        rep = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i, j = torch.arange(hi - lo)[:, None], torch.arange(hi - lo)[None, :]
        ok = (j <= i) & ((i - j <= window_size[0]) | (window_size[0] < 0))
        p = ((qs @ ks.transpose(-1, -2)) * scale).masked_fill(~ok, float("-inf")).softmax(-1)
        out.append((p @ vs).transpose(0, 1))
    return torch.cat(out)


def _stand_in_varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
    """torch 2.10 / 2.11's signature: no enable_gqa, so k/v come with as many heads as q."""
    assert q.shape[1] == k.shape[1] == v.shape[1]
    return _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("kernel", [(_stand_in_varlen, True), (_stand_in_varlen_2_11, False)], ids=["2.12", "2.11"])
@pytest.mark.parametrize("d,dv,window,cu", [(24, 16, 50, [0, 1, 40, 300]), (16, 16, 9, [0, 300]),
                                            (12, 20, 64, [0, 5, 300]), (16, 16, 9, None)])
def test_varlen_plumbing_against_a_stand_in_kernel(monkeypatch, kernel, d, dv, window, cu):
    """The CUDA varlen path's token layout, head-dim padding, scale, window and GQA arguments (a flag from torch
    2.12, kv heads repeated before it), checked on CPU with a stand-in for the kernel (the real kernel:
    test_cuda_varlen_flash_matches_dense_reference)."""
    monkeypatch.setattr(sdpa, "_VARLEN", kernel)
    monkeypatch.setattr(sdpa, "_flash_varlen_ok", lambda q, k, v: True)
    B = 1 if cu is not None else 3
    cu_t = None if cu is None else torch.tensor(cu)
    inputs = _qkv(300, d=d, dv=dv, B=B)
    want = (lambda q, k, v: dense_reference(q, k, v, 0, window, cu_t)) if cu is not None else \
        (lambda q, k, v: torch.cat([dense_reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], 0, window) for i in range(B)]))
    _check(lambda q, k, v: attend(q, k, v, 0, window, cu_t), want, inputs, 1e-10)


@pytest.mark.parametrize("cu", [[0, 1, 40, 300], None])
def test_global_layers_stay_on_sdpa_per_sequence(monkeypatch, cu):
    """Global (MLA) layers attend one sequence at a time through SDPA even where varlen FlashAttention applies:
    on the H200 that path was the faster one for them (model/attention/sdpa.py)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a global layer went through varlen FlashAttention")

    monkeypatch.setattr(sdpa, "_VARLEN", (refuse, True))
    monkeypatch.setattr(sdpa, "_flash_varlen_ok", lambda q, k, v: True)
    cu_t = None if cu is None else torch.tensor(cu)
    q, k, v = (x.detach() for x in _qkv(300, d=24, dv=16, B=1))
    torch.testing.assert_close(attend(q, k, v, 0, None, cu_t), dense_reference(q, k, v, 0, None, cu_t).to(q.dtype),
                               rtol=1e-5, atol=1e-5)
