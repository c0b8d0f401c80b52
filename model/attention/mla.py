"""Gated Multi-head Latent Attention (G layers).

    c_kv, k_pe = split(kv_a_proj_with_mqa x)        c_kv [B, T, kv_lora_rank] -> kv_a_layernorm; k_pe [B, T, rope]
    q          = q_proj x  (or q_b(norm(q_a x)))    [B, T, H, nope + rope]
    k_nope, v  = split(kv_b_proj c_kv)              per head [nope], [v_head_dim]
    k          = [k_nope, k_pe (shared by all heads)]
    out        = o_proj(SDPA(q, k, v) * sigmoid(g_proj x))   gate per head and channel, before o_proj

The cache holds only c_kv (after its norm) and k_pe per token: kv_lora_rank + qk_rope_head_dim values.
With ``mla_use_rope`` (default False, as Kimi Linear) q_pe/k_pe are rotated; otherwise the layer is position-free.
Keys/values are re-expanded from the latent at every step (no weight absorption: simple, exact).
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention.sdpa import attend
from model.chunking import over_tokens
from model.config import MarathonConfig
from model.norm import RMSNorm
from model.rope import RotaryEmbedding, apply_rotary


class GatedMLA(nn.Module):
    def __init__(self, config: MarathonConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.mla_num_heads
        self.num_heads, self.kv_lora_rank = H, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        q_dim = H * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        self.rotary = RotaryEmbedding(self.rope, config.rope_theta) if config.mla_use_rope else None

    def forward(self, x, position_ids, cache=None, cu_seqlens=None, attn_mask_2d=None):
        """Same arguments as `SlidingWindowAttention.forward`; cache is a `LatentCache`. Returns [B, T, D]."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, r]
        if self.rotary is not None:
            cos, sin = self.rotary(position_ids)
            q_pe = apply_rotary(q_pe, cos, sin)
            k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin).squeeze(2)  # [B, T, rope]
        past = 0
        if cache is not None:
            past = cache.seen
            c_kv, k_pe = cache.update(c_kv, k_pe)  # [B, S, r], [B, S, rope]
        S = c_kv.shape[1]
        k_nope, v = self.kv_b_proj(c_kv).view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.rope)], dim=-1).transpose(1, 2)  # [B, H, S, qk]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, T, qk]
        key_mask = None if attn_mask_2d is None else attn_mask_2d[:, -S:]
        o = attend(q, k, v.transpose(1, 2), past, None, cu_seqlens, key_mask)  # [B, H, T, v]
        return self.output(o.transpose(1, 2), x)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output o [B, T, H, v] and the layer input x [B, T, D] -> o_proj(o * sigmoid(g_proj x))
        [B, T, D], in token chunks on long rows (`model.chunking`)."""
        return over_tokens(self._gated_output, o, x)

    def _gated_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T, H, _ = o.shape
        o = o * torch.sigmoid(self.g_proj(x).view(B, T, H, self.v_dim))  # [B, T, H, v]
        return self.o_proj(o.reshape(B, T, H * self.v_dim))
