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
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model import chunking
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
        """Same arguments as `SlidingWindowAttention.forward`; cache is a `LatentCache`. Returns [B, T, D].

        Without a cache, a row longer than 4 ``model.chunking.TOKEN_CHUNK`` runs its heads in groups
        (`_head_groups`); otherwise all heads at once."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, r]
        q_in = x if hasattr(self, "q_proj") else self.q_a_layernorm(self.q_a_proj(x))  # [B, T, D or q_lora]
        rotary = None
        if self.rotary is not None:
            rotary = self.rotary(position_ids)
            k_pe = apply_rotary(k_pe.unsqueeze(2), *rotary).squeeze(2)  # [B, T, rope]
        past = 0
        if cache is not None:
            past = cache.seen
            c_kv, k_pe = cache.update(c_kv, k_pe)  # [B, S, r], [B, S, rope]
        key_mask = None if attn_mask_2d is None else attn_mask_2d[:, -c_kv.shape[1]:]
        per_group = self._heads_per_group(x.shape[1]) if cache is None else self.num_heads
        if per_group == self.num_heads:
            o = self._attend(q_in, c_kv, k_pe, rotary, past, cu_seqlens, key_mask, 0, self.num_heads)
            return self.output(o, x)
        return self._head_groups(x, q_in, c_kv, k_pe, rotary, cu_seqlens, key_mask, per_group)

    def _heads_per_group(self, T: int) -> int:
        """Heads per group: all of them up to 4 ``TOKEN_CHUNK`` tokens, then fewer as T grows (4 of 16 at 1M
        tokens with 64K chunks). A group's q/k/v/output and their gradients are ~40 KiB per token at all 16 heads
        of ``learner-bench``: ~77 GiB for one 1M-token recompute + backward in one group (H200, 512K measured).
        ZeRO-3 partitioned weights (``ds_id``) are only gathered through the modules' own calls: all heads."""
        if hasattr(self.o_proj.weight, "ds_id"):
            return self.num_heads
        return max(1, min(self.num_heads, self.num_heads * 4 * chunking.TOKEN_CHUNK // T))

    def _attend(self, q_in, c_kv, k_pe, rotary, past, cu_seqlens, key_mask, lo: int, hi: int) -> torch.Tensor:
        """Attention of heads [lo, hi): q_in [B, T, *] (x, or the normalised q_a projection), c_kv [B, S, r],
        k_pe [B, S, rope] -> o [B, T, hi - lo, v]."""
        B, T, S, H = q_in.shape[0], q_in.shape[1], c_kv.shape[1], hi - lo
        q_lin = self.q_proj if hasattr(self, "q_proj") else self.q_b_proj
        q = self._rows(q_lin, q_in, lo, hi, self.nope + self.rope).view(B, T, H, self.nope + self.rope)
        if rotary is not None:  # only the rope channels turn; without RoPE q is the projection as it is (no copy)
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_pe, *rotary)], dim=-1)
        kv = self._rows(self.kv_b_proj, c_kv, lo, hi, self.nope + self.v_dim)
        k_nope, v = kv.view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.rope)], dim=-1).transpose(1, 2)  # [B, H, S, qk]
        o = attend(q.transpose(1, 2), k, v.transpose(1, 2), past, None, cu_seqlens, key_mask)  # [B, H, T, v]
        return o.transpose(1, 2)  # [B, T, H, v]

    def _rows(self, linear: nn.Linear, x: torch.Tensor, lo: int, hi: int, per_head: int,
              on_input: bool = False) -> torch.Tensor:
        """``linear`` restricted to heads [lo, hi): its output columns of those heads (``on_input``: its input
        columns); the module's own call for all heads."""
        if lo == 0 and hi == self.num_heads:
            return linear(x)
        cols = slice(lo * per_head, hi * per_head)
        return F.linear(x, linear.weight[:, cols] if on_input else linear.weight[cols])

    def _head_groups(self, x, q_in, c_kv, k_pe, rotary, cu_seqlens, key_mask, per_group: int) -> torch.Tensor:
        """sum over head groups of o_proj(o_g * sigmoid(g_proj x)_g) restricted to the group's columns [B, T, D],
        each group recomputed in backward: only x, the latent and the output span all heads."""
        out = None
        for lo in range(0, self.num_heads, per_group):
            hi = min(lo + per_group, self.num_heads)
            args = (x, q_in, c_kv, k_pe, rotary, cu_seqlens, key_mask, lo, hi)
            part = (checkpoint(self._group_output, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else self._group_output(*args))
            out = part if out is None else out + part
        return out

    def _group_output(self, x, q_in, c_kv, k_pe, rotary, cu_seqlens, key_mask, lo: int, hi: int) -> torch.Tensor:
        o = self._attend(q_in, c_kv, k_pe, rotary, 0, cu_seqlens, key_mask, lo, hi)  # [B, T, h, v]
        return self._gated_output(o, x, lo, hi)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output o [B, T, H, v] and the layer input x [B, T, D] -> o_proj(o * sigmoid(g_proj x))
        [B, T, D], in token chunks on long rows (`model.chunking`)."""
        return over_tokens(self._gated_output, o, x)

    def _gated_output(self, o: torch.Tensor, x: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """o [B, T, h, v] of heads [lo, hi) (all by default) -> their share of o_proj(o * sigmoid(g_proj x))."""
        B, T, H, _ = o.shape
        hi = self.num_heads if hi is None else hi
        gate = self._rows(self.g_proj, x, lo, hi, self.v_dim).view(B, T, H, self.v_dim)
        o = (o * torch.sigmoid(gate)).reshape(B, T, H * self.v_dim)  # [B, T, h * v]
        return self._rows(self.o_proj, o, lo, hi, self.v_dim, on_input=True)
