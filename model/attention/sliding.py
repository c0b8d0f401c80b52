"""Sliding-window GQA attention with RoPE (S layers). The cache keeps only the last `sliding_window - 1`
tokens' keys/values: all that the next token can see besides itself."""

from __future__ import annotations

import torch
from torch import nn

from model.attention.sdpa import attend
from model.chunking import over_tokens
from model.config import MarathonConfig
from model.rope import RotaryEmbedding, apply_rotary


class SlidingWindowAttention(nn.Module):
    def __init__(self, config: MarathonConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.window = config.sliding_window
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, x, position_ids, cache=None, cu_seqlens=None, attn_mask_2d=None):
        """x [B, T, D]; position_ids [B, T]; cache: `SlidingKVCache` or None; cu_seqlens [N+1] for packed rows;
        attn_mask_2d [B, past+T] (HF padding mask) or None. Returns [B, T, D]. The projections and the rotary
        embedding (fp32) run in token chunks on long rows (`model.chunking`)."""
        q, k, v = (t.transpose(1, 2) for t in over_tokens(self._qkv, x, position_ids))  # [B, H, T, hd]
        past = 0
        if cache is not None:
            past = cache.seen
            k, v = cache.update(k, v, keep=self.window - 1)  # [B, Hkv, kv_len, hd]
        kv_len = k.shape[2]
        key_mask = None if attn_mask_2d is None else attn_mask_2d[:, -kv_len:]
        o = attend(q, k, v, past, self.window, cu_seqlens, key_mask)  # [B, Hq, T, hd]
        return over_tokens(self._out, o.transpose(1, 2))

    def _qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D], position_ids [B, T] -> q [B, T, Hq, hd], k, v [B, T, Hkv, hd] (q, k rotated)."""
        B, T, _ = x.shape
        Hq, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.rotary(position_ids)
        q = apply_rotary(self.q_proj(x).view(B, T, Hq, hd), cos, sin)
        k = apply_rotary(self.k_proj(x).view(B, T, Hkv, hd), cos, sin)
        return q, k, self.v_proj(x).view(B, T, Hkv, hd)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, Hq, hd] -> o_proj [B, T, D]."""
        return self.o_proj(o.flatten(-2))
