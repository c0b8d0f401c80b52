"""Softmax-attention layers of the hybrid layout on vLLM's paged KV cache (`Attention`).

S: sliding-window GQA with RoPE; vLLM's per-layer sliding window (the cache manager frees blocks that fall out
   of the window).
G: gated MLA served as multi-query attention over the latent. vLLM picks its MLA backends only for model types
   on an allow-list (`ModelArchConfigConvertor.is_deepseek_mla`), and the CPU MLA backend would force
   block_size 16 and disable chunked prefill for the whole hybrid model. Instead the key up-projection is
   absorbed into the query and the value up-projection applied after attention:
       score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = [W_UK_h^T q_nope_h, q_pe_h] . [c, k_pe]
       o_h     = sum_j a_hj W_UV_h c_j = W_UV_h (sum_j a_hj c_j)
   so the paged cache holds one KV "head" of size kv_lora_rank + qk_rope_head_dim per token: the latent and
   the rope key. vLLM's CPU attention has no separate value head size, so the value slot repeats the key
   (the attention output's first kv_lora_rank channels are the mixed latent).
   Served cache bytes: the latent is cached TWICE, kv = [c_kv, k_pe] once as the key and again as the value,
   2 * (kv_lora_rank + qk_rope_head_dim) elements per token and G layer (tiny fp32: 768 B; the 48B shapes in
   bf16: 2304 B, against 1152 B for the latent once). Under tensor parallelism every rank caches the whole
   latent (it is shared by all heads), so a TP engine holds tp such copies. Caching it once needs an MLA
   backend (a value slot of size 0 or a kernel reading v from k), which vLLM's CPU attention does not have.

Tensor parallelism: q heads are split (sliding: KV heads split too, or replicated when there are fewer KV
heads than ranks; MLA: the per-head q / kv_b / g projections split, the latent projection kv_a_proj_with_mqa and
its norm replicated, the one latent KV head on every rank); o_proj is row-parallel and all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig
from vllm.model_executor.layers.attention import Attention

from model.config import MarathonConfig
from model.norm import RMSNorm
from model.rope import RotaryEmbedding, apply_rotary
from rollout.vllm_plugin import tp


class _Rope(nn.Module):
    """The learner's rotary embedding (model/rope.py: fp32 angles and rotation, rotate-half), on vLLM's flat
    token layout; vLLM's own rotary layer rotates with a table in the model dtype."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.rotary = RotaryEmbedding(dim, theta)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """positions [N]; each x [N, heads * dim] -> rotated, same shape and dtype."""
        cos, sin = self.rotary(positions[None])  # [1, N, dim] fp32
        dim = cos.shape[-1]
        return tuple(apply_rotary(x.view(1, x.shape[0], -1, dim), cos, sin).view_as(x) for x in xs)


def _rope(config: MarathonConfig, dim: int) -> _Rope:
    return _Rope(dim, config.rope_theta)


def _check_cpu_head_size(head_size: int) -> None:
    """vLLM's CPU attention kernels exist for a fixed set of head sizes; say which config keys to change."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in sizes:
        raise ValueError(
            f"gated MLA is served as one latent KV head of kv_lora_rank + qk_rope_head_dim = {head_size}, but "
            f"vLLM's CPU attention supports head sizes {sizes}"
        )


class MarathonSlidingAttention(nn.Module):
    def __init__(self, config: MarathonConfig, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        D, hd, ranks = config.hidden_size, config.head_dim, tp.tp_size()
        heads, kv_heads = config.num_attention_heads // ranks, tp.kv_heads_local(config.num_key_value_heads, ranks)
        q_size, kv_size = heads * hd, kv_heads * hd  # this rank's
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, q_size, bias=False), nn.Linear(D, kv_size, bias=False), nn.Linear(D, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, D, bias=False)
        tp.column(self.q_proj)
        replicas = max(1, ranks // config.num_key_value_heads)  # ranks sharing one KV head
        tp.shard(self.k_proj, 0, replicas)
        tp.shard(self.v_proj, 0, replicas)
        tp.row(self.o_proj)
        self.rotary_emb = _rope(config, hd)
        self.attn = Attention(
            heads,
            hd,
            hd**-0.5,
            num_kv_heads=kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=config.sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k = self.rotary_emb(positions, self.q_proj(x), self.k_proj(x))
        return tp.all_reduce(self.o_proj(self.attn(q, k, self.v_proj(x))))


class MarathonLatentAttention(nn.Module):
    """Parameter names are those of `model.attention.mla.GatedMLA`. H: this rank's heads (module doc)."""

    def __init__(self, config: MarathonConfig, prefix: str):
        super().__init__()
        D, H = config.hidden_size, config.mla_num_heads // tp.tp_size()
        self.num_heads, self.kv_lora_rank = H, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim

        def linear(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False)

        q_dim = H * (self.nope + self.rope)
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = linear(D, q_dim)
        else:
            self.q_a_proj = linear(D, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = linear(config.q_lora_rank, q_dim)
        self.kv_a_proj_with_mqa = linear(D, self.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = linear(self.kv_lora_rank, H * (self.nope + self.v_dim))  # used absorbed (weight only)
        self.g_proj = linear(D, H * self.v_dim)
        self.o_proj = linear(H * self.v_dim, D)
        tp.column(self.q_proj if config.q_lora_rank is None else self.q_b_proj, self.kv_b_proj, self.g_proj)
        tp.row(self.o_proj)
        self.rotary_emb = _rope(config, self.rope) if config.mla_use_rope else None
        self.latent_dim = self.kv_lora_rank + self.rope
        _check_cpu_head_size(self.latent_dim)
        # cache_config=None: the model-level `sliding_window` must not apply to global layers
        self.attn = Attention(
            H, self.latent_dim, (self.nope + self.rope) ** -0.5, num_kv_heads=1, cache_config=None, prefix=f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        N, H, r = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(N, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [N, r]
        if self.rotary_emb is not None:
            q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(N, H * self.rope), k_pe.contiguous())
            q_pe = q_pe.view(N, H, self.rope)
        w_uk, w_uv = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, r).split([self.nope, self.v_dim], dim=1)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [N, H, r]: W_UK absorbed into q
        q = torch.cat([q_lat, q_pe], dim=-1).reshape(N, H * self.latent_dim)
        kv = torch.cat([c_kv, k_pe], dim=-1)  # [N, r + rope]: the one cached KV head
        o = self.attn(q, kv, kv).view(N, H, self.latent_dim)[..., :r]  # mixed latent per head
        o = torch.einsum("nhr,hvr->nhv", o, w_uv)  # [N, H, v]: W_UV applied after attention
        o = o * torch.sigmoid(self.g_proj(x).view(N, H, self.v_dim))
        return tp.all_reduce(self.o_proj(o.reshape(N, H * self.v_dim)))  # [N, D]
