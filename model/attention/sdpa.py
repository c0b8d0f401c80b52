"""Softmax attention for sliding and global layers: SDPA with cache offsets, windows, packed rows and left
padding. Packed rows run one segment at a time (no [T, T] mask over the whole row)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    cu_seqlens [N+1] (B = 1, no past): causal attention inside each packed sequence only."""
    gqa = q.shape[1] != k.shape[1]
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        return torch.cat(
            [attend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], 0, window) for lo, hi in zip(bounds[:-1], bounds[1:])],
            dim=2,
        )
    T = q.shape[2]
    mask = attention_mask(T, k.shape[2], past, window, key_mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=gqa)
