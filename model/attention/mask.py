"""Boolean attention masks (True = attend) for sliding and global layers, with cache offsets, windows,
packed rows (block-diagonal) and left padding."""

from __future__ import annotations

import torch


def attention_mask(
    q_len: int,
    kv_len: int,
    past: int,
    window: int | None = None,
    seg_ids: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Query i sits at stream index past+i; the kv_len keys are the stream's last tokens up to past+q_len-1.

    window: a query sees keys with q - k < window. seg_ids [T] (packed rows, no cache): keys of the same
    sequence only. key_mask [B, kv_len] (0 = left padding): masked keys, except each token still sees itself
    so a padding row never goes all -inf. Returns [B or 1, 1, q_len, kv_len] bool, or None when SDPA's
    is_causal (q_len > 1, no past) or no mask at all (q_len == 1) is exact.
    """
    if key_mask is None and seg_ids is None:
        window_ok = window is None or window >= (kv_len if q_len == 1 else q_len)
        if window_ok and (q_len == 1 or (past == 0 and kv_len == q_len)):
            return None
    first_key = past + q_len - kv_len
    device = key_mask.device if key_mask is not None else (seg_ids.device if seg_ids is not None else None)
    qi = torch.arange(past, past + q_len, device=device)[:, None]  # [q, 1]
    ki = torch.arange(first_key, past + q_len, device=device)[None, :]  # [1, kv]
    allowed = ki <= qi
    if window is not None:
        allowed = allowed & (qi - ki < window)
    if seg_ids is not None:
        allowed = allowed & (seg_ids[:, None] == seg_ids[None, :])
    allowed = allowed[None, None]  # [1, 1, q, kv]
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :] | (qi == ki)[None, None]
    return allowed
