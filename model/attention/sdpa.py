"""Softmax attention for sliding and global layers: SDPA with cache offsets, windows, packed rows and left
padding, with no [T, T] anything on the training path (memory linear in T).

Self-attention over whole sequences (training, prefill: no past, no padding mask), per device:
- a sliding window on CUDA in fp16/bf16: FlashAttention's varlen kernel (``torch.nn.attention.varlen``) over the
  packed row (or the B rows of a batch laid end to end) in one call, the window as its left window size; head
  dims padded with zeros to a common multiple of 8 where q/k and v differ.
- a global layer: one sequence at a time through SDPA with ``is_causal=True`` (cuDNN's or FlashAttention's fused
  kernels on CUDA: O(T) memory). On the H200 at 64K tokens the MLA layers' forward / backward took 13.7 / 39.3 ms
  that way and 20.7 / 52.7 ms through varlen FlashAttention (v padded from 128 to MLA's q/k head dim 192; that
  run also had ``learner.compile``): benchmarks/learner/h200/README.md.
- a sliding window elsewhere (CPU, fp32 CUDA, a torch before 2.10's windowed varlen): one sequence at a time
  through query blocks (`_window_blocks`): each block of Bq queries attends to the Bq + W - 1 keys it can see with
  a small additive mask, O(T (Bq + W)) work and an O(Bq (Bq + W)) mask per block, shared by all full interior
  blocks.
Decoding and padded generation batches (``past`` > 0 with a global layer, ``key_mask``) build the explicit
[q_len, kv_len] mask of `attention_mask`: q_len is the step's new tokens there.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

WINDOW_BLOCK_MIN, WINDOW_BLOCK_MAX = 128, 1024  # queries per sliding-window block: clamp(W, min, max)


def attention_mask(
    q_len: int,
    kv_len: int,
    past: int,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Query i sits at stream index past+i; the kv_len keys are the stream's last tokens up to past+q_len-1.

    window: a query sees keys with q - k < window. key_mask [B, kv_len] (0 = padding): masked keys, except
    each token still sees itself so a padding row never goes all -inf. Returns [B or 1, 1, q_len, kv_len]
    bool (True = attend), or None when SDPA's is_causal (q_len > 1, no past) or no mask (q_len == 1) is exact.
    """
    if key_mask is None:
        window_ok = window is None or window >= (kv_len if q_len == 1 else q_len)
        if window_ok and (q_len == 1 or (past == 0 and kv_len == q_len)):
            return None
    qi = torch.arange(past, past + q_len, device=device)[:, None]  # [q, 1]
    ki = torch.arange(past + q_len - kv_len, past + q_len, device=device)[None, :]  # [1, kv]
    allowed = ki <= qi
    if window is not None:
        allowed = allowed & (qi - ki < window)
    allowed = allowed[None, None]  # [1, 1, q, kv]
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :] | (qi == ki)[None, None]
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int = 0,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, d], k [B, Hkv, S, d], v [B, Hkv, S, dv] (Hq a multiple of Hkv) -> [B, Hq, T, dv].

    Query i sits at stream index past + i, the S keys are the stream's last S tokens up to past + T - 1
    (``attention_mask``). window: a query sees keys with q - k < window. cu_seqlens [N+1] (B = 1, no past,
    no key_mask): causal attention inside each packed sequence only. key_mask [B, S] (0 = left padding)."""
    T, S = q.shape[2], k.shape[2]
    if cu_seqlens is not None:
        if past or key_mask is not None or S != T:
            raise ValueError("packed rows (cu_seqlens) attend within themselves: no past, no key_mask")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if window is not None and _flash_varlen_ok(q, k, v):
            return _flash_varlen(q, k, v, bounds, window)
        if len(bounds) == 2:
            return _self_attention(q, k, v, window)
        # split, not sliced: the backward puts the sequences' gradients together with one cat per tensor,
        # where a slice's backward writes its gradient into a zeroed [B, H, T, d] and those are summed
        sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        return torch.cat([_self_attention(*qkv, window)
                          for qkv in zip(q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2))], dim=2)
    if key_mask is None and past == 0 and S == T and T > 1:  # whole sequences: training, prefill
        if window is not None and _flash_varlen_ok(q, k, v):
            return _flash_varlen(q, k, v, [i * T for i in range(q.shape[0] + 1)], window)
        return _self_attention(q, k, v, window)
    if key_mask is None and window is not None and T > 1 and window < T:  # a window over a carried prefix
        return _window_blocks(q, k, v, past, window)
    mask = attention_mask(T, S, past, window, key_mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal attention of a whole sequence (q, k, v over the same T tokens, no past)."""
    T = q.shape[2]
    if window is None or window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=q.shape[1] != k.shape[1])
    return _window_blocks(q, k, v, 0, window)


def _window_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int) -> torch.Tensor:
    """Sliding-window causal attention in query blocks. Query i sits at stream index past + i, key j at
    past + T - S + j (as `attention_mask`). A block of queries [s, e) sees the keys from stream index
    past + s - window + 1 to past + e - 1: one SDPA call over that key range with a [e - s, keys] additive
    mask (0 / -inf) built once per distinct block geometry (every full interior block shares one), so no
    mask, score or mask copy is larger than the block."""
    T, S = q.shape[2], k.shape[2]
    off = past + T - S  # stream index of key 0
    block = min(max(window, WINDOW_BLOCK_MIN), WINDOW_BLOCK_MAX)
    gqa = q.shape[1] != k.shape[1]
    masks: dict[tuple[int, int, int], torch.Tensor | None] = {}
    out = []
    for s in range(0, T, block):
        e = min(T, s + block)
        lo = max(0, past + s - window + 1 - off)  # first visible key
        hi = past + e - off  # one past the last visible key
        geometry = (e - s, hi - lo, past + s - (off + lo))  # queries, keys, stream offset query 0 - key 0
        if geometry not in masks:
            masks[geometry] = _block_mask(*geometry, window, q.dtype, q.device)
        mask = masks[geometry]
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask,
                                                  is_causal=False, enable_gqa=gqa))
    return torch.cat(out, dim=2) if len(out) > 1 else out[0]


def _block_mask(n_q: int, n_k: int, delta: int, window: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """[n_q, n_k] additive mask (0 = attend, -inf = not) for queries at stream delta + a over keys at b:
    key b visible from query a iff 0 <= (delta + a) - b < window. None when every key is visible."""
    rel = delta + torch.arange(n_q, device=device)[:, None] - torch.arange(n_k, device=device)[None, :]
    allowed = (rel >= 0) & (rel < window)
    if bool(allowed.all()):
        return None
    # rows padded to a multiple of 16 elements: CUDA's memory-efficient kernel takes the view as it is (an
    # unaligned mask would be copied, padded, per call - and kept per block for the backward)
    mask = torch.zeros(n_q, -(-n_k // 16) * 16, dtype=dtype, device=device)[:, :n_k]
    return mask.masked_fill_(~allowed, float("-inf"))


# -- CUDA: FlashAttention varlen --------------------------------------------------------------------------------

_VARLEN = None  # (varlen_attn, whether it takes enable_gqa) when it takes windows and a scale, else False (lazily)


def _varlen_fn() -> tuple | bool:
    """torch.nn.attention.varlen.varlen_attn with ``window_size`` and ``scale`` (torch 2.10+), and whether it takes
    ``enable_gqa`` (2.12+; https://docs.pytorch.org/docs/2.12/nn.attention.varlen.html); False without them."""
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn

            params = set(inspect.signature(varlen_attn).parameters)
            _VARLEN = (varlen_attn, "enable_gqa" in params) if {"window_size", "scale"} <= params else False
        except ImportError:
            _VARLEN = False
    return _VARLEN


def _flash_varlen_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """FlashAttention's varlen kernel applies: CUDA, half precision, head dims up to 256."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    return max(q.shape[-1], v.shape[-1]) <= 256 and bool(_varlen_fn())


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                  window: int | None) -> torch.Tensor:
    """q [B, Hq, T, d], k/v [B, Hkv, T, d|dv] holding the sequences ``bounds`` (offsets into the B*T tokens laid
    end to end) -> [B, Hq, T, dv], causal within each sequence, through one varlen FlashAttention call."""
    B, Hq, T, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    D = -(-max(d, dv) // 8) * 8  # one head dim for q, k and v (the kernel needs them equal, multiple of 8)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, e] -> [B*T, H, D]
        x = x.transpose(1, 2).reshape(B * T, x.shape[1], x.shape[-1])
        return F.pad(x, (0, D - x.shape[-1])) if x.shape[-1] < D else x.contiguous()

    varlen_attn, takes_gqa = _varlen_fn()
    gqa = {}
    if Hq != Hkv and takes_gqa:
        gqa["enable_gqa"] = True
    elif Hq != Hkv:  # torch 2.10 / 2.11: no GQA flag, so each kv head repeated for its Hq / Hkv query heads
        k, v = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    left = -1 if window is None or window >= longest else window - 1
    o = varlen_attn(tokens(q), tokens(k), tokens(v), cu, cu, longest, longest, scale=d**-0.5,
                    window_size=(left, 0), **gqa)  # [B*T, Hq, D]
    return o[..., :dv].reshape(B, T, Hq, dv).transpose(1, 2)
