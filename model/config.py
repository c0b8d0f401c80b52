"""`MarathonConfig`: the hybrid-attention MoE transformer's hyper-parameters, with named size presets.

Layer layout: ``layer_layout`` is a string with one letter per layer - ``L`` linear attention (KDA-style gated
delta rule), ``S`` sliding-window GQA attention, ``G`` global gated MLA. A layout shorter than
``num_hidden_layers`` is repeated (``"LSLG"`` over 8 layers is ``"LSLGLSLG"``). The field is not called
``layer_types`` because transformers validates that name against its own layer-type vocabulary.

Presets (``MarathonConfig.from_preset(name, **overrides)``):
- ``tiny``: CPU tests and vLLM-CPU plugin tests (~1.3M params; head dims 64 everywhere, as vLLM's CPU attention
  needs).
- ``learner-bench``: `marathon bench learner`'s hybrid MoE at real widths (hidden 2048, vocab 131072, KDA heads
  of 128, 32 experts), ~2B parameters.
- ``kimi-linear-48b-a3b``: the public Kimi-Linear-48B-A3B shapes (27 layers, KDA:MLA 3:1, 256 routed experts
  top-8 + 1 shared, first layer dense, MLA without RoPE). ~49B total / ~3B activated (see tests).
- ``marathon-93l-896e``: the larger successor per DESIGN_NOTES (93 layers = 69 KDA + 24 gated MLA, 896 routed
  + 2 shared experts, 16 active, attention residuals over 12-layer blocks). Hidden / expert widths are not
  public; ours (hidden 4096, expert width 768) are assumptions, documented here.
"""

from __future__ import annotations

from typing import Literal

from transformers import PreTrainedConfig

LAYER_KINDS = {"L": "linear", "S": "sliding", "G": "global"}


class MarathonConfig(PreTrainedConfig):
    model_type = "marathon"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 4
    layer_layout: str = "LSLG"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    max_position_embeddings: int = 8192
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # Sliding-window attention (S): GQA + RoPE; a token sees the last `sliding_window` tokens, itself included.
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    sliding_window: int = 64
    rope_theta: float = 10000.0  # context-extension stages change this (only S layers, and G if mla_use_rope)

    # Linear attention (L): KDA-style gated delta rule.
    linear_num_heads: int = 2
    linear_head_k_dim: int = 64
    linear_head_v_dim: int = 64
    linear_conv_kernel: int = 4
    linear_gate_fn: Literal["bounded", "softplus"] = "bounded"  # g = g_min*sigmoid(A*(raw+dt)) | -A*softplus(raw+dt)
    linear_g_min: float = -5.0

    # Gated MLA (G): latent KV cache (kv_lora_rank + qk_rope_head_dim per token), sigmoid output gate.
    mla_num_heads: int = 2
    q_lora_rank: int | None = None  # None: a full-rank q_proj (as Kimi Linear)
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    mla_use_rope: bool = False  # Kimi Linear: MLA layers carry no positional encoding (KDA layers do)

    # Block attention residuals (arXiv 2603.15031): a layer's input is a learned softmax mix over block outputs.
    attn_residual: bool = True
    attn_residual_block_size: int = 2  # decoder layers per block

    # Feed-forward: the first `first_k_dense` layers use a dense SwiGLU MLP, the rest MoE.
    intermediate_size: int = 256
    first_k_dense: int = 1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    routed_scaling_factor: float = 1.0
    router_logit_clip: float = 10.0  # router logits clamped to [-c, c] before the sigmoid
    # Quantile balancing (no auxiliary loss); both modes change expert SELECTION only, never the weights.
    router_balance_mode: Literal["quantile", "bias", "none"] = "quantile"
    router_ema_decay: float = 0.9  # EMA of each expert's relative load (1.0 = its fair share)
    router_high_quantile: float = 0.9  # "quantile" mode: experts above this load quantile are shrunk ...
    router_low_quantile: float = 0.1  # ... and those below this one boosted
    router_shrink_factor: float = 0.9  # multiplicative update of the expert's selection scale
    router_boost_factor: float = 1.1
    router_scale_bounds: tuple[float, float] = (0.05, 20.0)
    router_bias_rate: float = 1.0  # "bias" mode: b <- (1-rate) b + rate (quantile estimate - mean)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if isinstance(self.router_scale_bounds, list):  # JSON round trip
            self.router_scale_bounds = tuple(self.router_scale_bounds)
        bad = set(self.layer_layout) - set(LAYER_KINDS)
        if not self.layer_layout or bad:
            raise ValueError(f"layer_layout must use only {sorted(LAYER_KINDS)}, got {self.layer_layout!r}")
        if self.linear_gate_fn not in ("bounded", "softplus"):
            raise ValueError(f"linear_gate_fn must be 'bounded' or 'softplus', got {self.linear_gate_fn!r}")
        if self.router_balance_mode not in ("quantile", "bias", "none"):
            raise ValueError(f"router_balance_mode must be quantile|bias|none, got {self.router_balance_mode!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.num_experts_per_tok < self.n_routed_experts:
            raise ValueError("need 0 < num_experts_per_tok < n_routed_experts")

    @property
    def layer_kinds(self) -> list[str]:
        """One letter per layer (L/S/G), the layout repeated to `num_hidden_layers`."""
        reps = -(-self.num_hidden_layers // len(self.layer_layout))
        return list((self.layer_layout * reps)[: self.num_hidden_layers])

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.first_k_dense, self.num_hidden_layers))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MarathonConfig":
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


_KIMI_LINEAR_48B = dict(
    vocab_size=163840,
    hidden_size=2304,
    num_hidden_layers=27,
    layer_layout="LLLG" * 6 + "LLG",  # MLA at layers 4, 8, ..., 24, 27 (1-based), as Kimi Linear
    max_position_embeddings=1048576,
    linear_num_heads=32,
    linear_head_k_dim=128,
    linear_head_v_dim=128,
    mla_num_heads=32,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_use_rope=False,
    num_attention_heads=32,  # S layers (none in this layout; used by `marathon bench memory`'s MHA/GQA rows)
    num_key_value_heads=8,
    head_dim=128,
    sliding_window=4096,
    attn_residual=False,
    intermediate_size=9216,
    first_k_dense=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=1024,
    routed_scaling_factor=2.446,
)

PRESETS: dict[str, dict] = {
    "tiny": {},
    # `marathon bench learner`: real widths at ~2B total parameters, so one RL update of a 1M-token episode fits
    # one H200 (bf16 weights, fp32 master weights and AdamW state, activation checkpointing)
    "learner-bench": dict(
        vocab_size=131072,
        hidden_size=2048,
        num_hidden_layers=12,
        layer_layout="LLSG",  # 6 KDA, 3 sliding-window GQA, 3 gated MLA
        max_position_embeddings=1048576,
        linear_num_heads=16,
        linear_head_k_dim=128,
        linear_head_v_dim=128,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        sliding_window=4096,
        mla_num_heads=16,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        attn_residual=True,
        attn_residual_block_size=4,
        intermediate_size=4096,
        first_k_dense=1,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_intermediate_size=512,
    ),
    "kimi-linear-48b-a3b": _KIMI_LINEAR_48B,
    "marathon-93l-896e": {
        **_KIMI_LINEAR_48B,
        "hidden_size": 4096,  # assumption (not public)
        "num_hidden_layers": 93,
        "layer_layout": "LLLG" * 23 + "G",  # 69 KDA + 24 MLA
        "attn_residual": True,
        "attn_residual_block_size": 12,
        "intermediate_size": 16384,
        "n_routed_experts": 896,
        "num_experts_per_tok": 16,
        "n_shared_experts": 2,
        "moe_intermediate_size": 768,  # assumption (not public)
        "routed_scaling_factor": 2.5,
    },
}
