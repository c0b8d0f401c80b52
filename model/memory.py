"""Decoding-cache bytes per sequence, computed from a `MarathonConfig` (what `MarathonCache` allocates).

Per layer, for a sequence of T tokens (kv = bytes of the model dtype, e.g. 2 for bf16; states are fp32):
    L  linear:   [(W-1) (2 H K + H V)  conv states  +  H K V  recurrent state] * 4      constant in T
    S  sliding:  min(T, window-1) * 2 * Hkv * head_dim * kv
    G  MLA:      T * (kv_lora_rank + qk_rope_head_dim) * kv
Reference designs over the same depth, for comparison: full MHA (every layer keeps 2 H head_dim per token),
GQA (2 Hkv head_dim), MLA everywhere.
"""

from __future__ import annotations

from model.config import MarathonConfig

FP32 = 4


def layer_cache_bytes(config: MarathonConfig, kind: str, tokens: int, kv_bytes: int = 2) -> int:
    c = config
    if kind == "L":
        H, K, V = c.linear_num_heads, c.linear_head_k_dim, c.linear_head_v_dim
        return ((c.linear_conv_kernel - 1) * (2 * H * K + H * V) + H * K * V) * FP32
    if kind == "S":
        return min(tokens, c.sliding_window - 1) * 2 * c.num_key_value_heads * c.head_dim * kv_bytes
    if kind == "G":
        return tokens * (c.kv_lora_rank + c.qk_rope_head_dim) * kv_bytes
    raise ValueError(f"unknown layer kind {kind!r}")


def cache_bytes(config: MarathonConfig, tokens: int, kv_bytes: int = 2) -> int:
    """The hybrid layout's cache for one sequence of `tokens` tokens."""
    return sum(layer_cache_bytes(config, kind, tokens, kv_bytes) for kind in config.layer_kinds)


def design_cache_bytes(config: MarathonConfig, tokens: int, kv_bytes: int = 2) -> dict[str, int]:
    """{design: bytes} for full MHA, GQA, MLA on every layer, and the config's hybrid layout."""
    c, n = config, config.num_hidden_layers
    return {
        "MHA": n * tokens * 2 * c.num_attention_heads * c.head_dim * kv_bytes,
        "GQA": n * tokens * 2 * c.num_key_value_heads * c.head_dim * kv_bytes,
        "MLA": n * layer_cache_bytes(c, "G", tokens, kv_bytes),
        "hybrid": cache_bytes(c, tokens, kv_bytes),
    }


def layout_summary(config: MarathonConfig) -> str:
    """e.g. "20L+7G" (S layers with their window)."""
    kinds = config.layer_kinds
    parts = [f"{kinds.count(k)}{k}" for k in "LSG" if k in kinds]
    return "+".join(parts) + (f" (window {config.sliding_window})" if "S" in kinds else "")


def designs_summary(config: MarathonConfig) -> str:
    c = config
    return (f"MHA: {c.num_attention_heads} heads x {c.head_dim}; GQA: {c.num_key_value_heads} KV heads x {c.head_dim}; "
            f"MLA: latent {c.kv_lora_rank} + rope key {c.qk_rope_head_dim}; linear state {c.linear_num_heads} x "
            f"{c.linear_head_k_dim} x {c.linear_head_v_dim} fp32 (+ conv {c.linear_conv_kernel - 1} taps)")
