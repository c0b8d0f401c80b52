"""`MarathonModel` / `MarathonForCausalLM`: the hybrid-attention MoE decoder.

Forward extras beyond the usual HF arguments:
- ``cu_seqlens`` (int [N+1], with B = 1): packed sequences; attention is block-diagonal, linear-attention and
  conv states reset at each boundary, positions restart per segment (unless ``position_ids`` is given), and
  the LM loss never predicts across a boundary.
- ``routed_experts``: LongTensor [num_moe_layers, B*T, top_k] (or a per-layer list) replaying a recorded
  expert selection; routing weights are recomputed from the current scores at those experts.
- ``return_routed_experts=True``: the output's ``routed_experts`` holds the selection in that same layout.
- ``attention_mask`` [B, past+T] with left padding (generation batches); positions follow the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from model.attention import GatedMLA, LinearAttention, SlidingWindowAttention
from model.attention.conv import ShortConv
from model.attn_residual import AttnResidualMix, ResidualWiring, run_layers
from model.cache import MarathonCache
from model.config import MarathonConfig
from model.moe import MoE, Router, Experts, SwiGLU, new_forward_id
from model.norm import RMSNorm

_MIXERS = {"L": LinearAttention, "S": SlidingWindowAttention, "G": GatedMLA}


@dataclass
class MarathonModelOutput(BaseModelOutputWithPast):
    routed_experts: torch.LongTensor | None = None  # [num_moe_layers, B*T, top_k]


@dataclass
class MarathonCausalLMOutput(CausalLMOutputWithPast):
    routed_experts: torch.LongTensor | None = None


@dataclass
class _Context:
    """Per-forward inputs every layer needs."""

    position_ids: torch.Tensor  # [B, T]
    cache: MarathonCache | None
    cu_seqlens: torch.Tensor | None  # [N+1]
    pos_in_seg: torch.Tensor | None  # [T]
    attn_mask_2d: torch.Tensor | None  # [B, past+T], None when there is no padding
    forward_id: int | None = None  # keys this forward's routing statistics (the same in a checkpoint recompute)


class DecoderLayer(ResidualWiring, nn.Module):
    def __init__(self, config: MarathonConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_kinds[layer_idx]
        self.layer_idx = layer_idx
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = _MIXERS[self.kind](config, layer_idx)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.is_moe = layer_idx >= config.first_k_dense
        self.mlp = MoE(config) if self.is_moe else SwiGLU(D, config.intermediate_size)
        self.add_residual_mixes(config, layer_idx)

    def mix(self, x: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """Token mixer on normalised input: [B, T, D] -> [B, T, D]."""
        cache = ctx.cache.layers[self.layer_idx] if ctx.cache is not None else None
        if self.kind == "L":
            return self.self_attn(x, cache, ctx.pos_in_seg, ctx.cu_seqlens, self._token_mask(ctx, x.shape[1]))
        return self.self_attn(x, ctx.position_ids, cache, ctx.cu_seqlens, ctx.attn_mask_2d)

    @staticmethod
    def _token_mask(ctx: _Context, T: int) -> torch.Tensor | None:
        return None if ctx.attn_mask_2d is None else ctx.attn_mask_2d[:, -T:].float()

    def ffn(self, x: torch.Tensor, forced: torch.Tensor | None,
            key: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_moe:
            return self.mlp(x, forced, key)
        return self.mlp(x), None

    def forward(self, hidden, blocks, ctx, forced=None, checkpoint=None):
        """hidden [B, T, D], blocks: as `ResidualWiring`. Returns (hidden, selected experts or None).

        checkpoint: a ``torch.utils.checkpoint.checkpoint``-like function (gradient checkpointing); the two halves
        of the layer (token mixer, then FFN) are recomputed separately in backward, so the backward holds one
        half's activations at a time."""
        run = checkpoint if checkpoint is not None else _call
        hidden = run(self.mixer_half, hidden, blocks, ctx)
        return run(self.ffn_half, hidden, blocks, forced, ctx.forward_id)


def _call(fn, *args):
    return fn(*args)


class MarathonPreTrainedModel(PreTrainedModel):
    config_class = MarathonConfig
    config: MarathonConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own MarathonCache (see MarathonModel.forward)

    def _init_weights(self, module):
        super()._init_weights(module)
        cfg, std = self.config, self.config.initializer_range
        out_std = std / (2 * cfg.num_hidden_layers) ** 0.5  # residual-branch outputs
        if isinstance(module, (LinearAttention, SlidingWindowAttention, GatedMLA, SwiGLU)):
            init.normal_((module.down_proj if isinstance(module, SwiGLU) else module.o_proj).weight, 0.0, out_std)
        if isinstance(module, LinearAttention):
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log_())
            init.copy_(module.dt_bias, LinearAttention._dt_bias_init(module.dt_bias.numel()).to(module.dt_bias))
        elif isinstance(module, ShortConv):
            init.kaiming_uniform_(module.weight, a=5**0.5)
        elif isinstance(module, Router):
            init.normal_(module.weight, 0.0, std)
            init.ones_(module.load_ema)
            init.ones_(module.expert_scale)
            init.zeros_(module.expert_bias)
            init.zeros_(module.tokens_per_expert)
        elif isinstance(module, Experts):
            init.normal_(module.gate_up_proj, 0.0, std)
            init.normal_(module.down_proj, 0.0, out_std)
        elif isinstance(module, AttnResidualMix):
            init.zeros_(module.query)


class MarathonModel(MarathonPreTrainedModel):
    def __init__(self, config: MarathonConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_res = AttnResidualMix(config.hidden_size, config.rms_norm_eps) if config.attn_residual else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def router_stats(self) -> dict[int, dict]:
        """{layer index: Router.stats()} for every MoE layer (the current or last update's token counts + EMA)."""
        return {layer.layer_idx: layer.mlp.router.stats() for layer in self.layers if layer.is_moe}

    def apply_router_updates(self) -> None:
        """Fold the routing statistics of the training forwards since the last update into the balancing state.
        A torch optimizer's step does this by itself (`model.moe`); call it by hand in loops without one."""
        for moe in self.moe_layers:
            moe.router.apply_pending()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MarathonCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        routed_experts: torch.Tensor | list[torch.Tensor] | None = None,
        return_routed_experts: bool = False,
        **kwargs,
    ) -> MarathonModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, D]
        B, T, _ = hidden.shape
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and cu_seqlens is None
        if use_cache and past_key_values is None:
            past_key_values = MarathonCache(self.config)
        cache = past_key_values if use_cache else None
        if cache is not None and not isinstance(cache, MarathonCache):
            raise TypeError(f"past_key_values must be a MarathonCache, got {type(cache).__name__}")
        past = cache.get_seq_length() if cache is not None else 0

        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the fast paths apply
        pos_in_seg = None
        if cu_seqlens is not None:
            if B != 1 or cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens packs sequences into one row: needs B == 1, no cache, no padding")
            cu_seqlens = cu_seqlens.to(hidden.device, torch.long)
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T or bool((cu_seqlens.diff() <= 0).any()):
                raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu_seqlens.tolist()}")
            seg_ids = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=hidden.device), cu_seqlens.diff())
            pos_in_seg = torch.arange(T, device=hidden.device) - cu_seqlens[seg_ids]
        if position_ids is None:
            if pos_in_seg is not None:
                position_ids = pos_in_seg[None]
            elif attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=hidden.device)[None].expand(B, T)
        ctx = _Context(position_ids, cache, cu_seqlens, pos_in_seg, attention_mask, new_forward_id())

        moe_ids = self.config.moe_layer_ids
        if routed_experts is not None and len(routed_experts) != len(moe_ids):
            raise ValueError(f"routed_experts needs one entry per MoE layer ({len(moe_ids)}), got {len(routed_experts)}")
        selected = []
        checkpoint = self._gradient_checkpointing_func if self.gradient_checkpointing and self.training else None

        def step(i, layer, stream, blocks):
            forced = routed_experts[i - moe_ids[0]] if routed_experts is not None and layer.is_moe else None
            stream, idx = layer(stream, blocks, ctx, forced, checkpoint)
            if idx is not None:
                selected.append(idx)
            return stream

        hidden = run_layers(self.layers, hidden, self.final_res, self.config.attn_residual_block_size, step, self.norm)
        if cache is not None:
            cache.advance(T)
        return MarathonModelOutput(
            last_hidden_state=hidden,
            past_key_values=cache,
            routed_experts=torch.stack(selected) if return_routed_experts and selected else None,
        )


class MarathonForCausalLM(MarathonPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MarathonConfig):
        super().__init__(config)
        self.model = MarathonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def router_stats(self) -> dict[int, dict]:
        return self.model.router_stats()

    def apply_router_updates(self) -> None:
        self.model.apply_router_updates()

    def parameter_counts(self) -> dict[str, int]:
        """total, activated per token (shared parts + top-k of the routed experts), and the embeddings' share.
        Works on the meta device."""
        cfg = self.config
        total = sum(p.numel() for p in self.parameters())
        routed = sum(p.numel() for m in self.model.moe_layers for p in m.experts.parameters())
        embeddings = self.model.embed_tokens.weight.numel() + (0 if cfg.tie_word_embeddings else self.lm_head.weight.numel())
        activated = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
        return {"total": total, "activated": activated, "embeddings": embeddings}

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MarathonCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        cu_seqlens: torch.Tensor | None = None,
        routed_experts: torch.Tensor | list[torch.Tensor] | None = None,
        return_routed_experts: bool = False,
        **kwargs,
    ) -> MarathonCausalLMOutput:
        """labels [B, T] are the input ids (shifted here); -100 is ignored. logits_to_keep > 0 keeps the last N."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            routed_experts=routed_experts,
            return_routed_experts=return_routed_experts,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # [B, T, vocab]
        loss = None
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # targets[t] = labels[t+1]
            if cu_seqlens is not None:
                targets[:, cu_seqlens[1:-1].to(targets.device) - 1] = -100  # never predict across a boundary
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return MarathonCausalLMOutput(
            loss=loss, logits=logits, past_key_values=out.past_key_values, routed_experts=out.routed_experts
        )
