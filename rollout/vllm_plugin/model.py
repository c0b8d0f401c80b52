"""`MarathonForCausalLM` for vLLM: the decoder of `model/modeling.py` on vLLM building blocks.

Token layout: vLLM flattens the batch to [N, D] (all scheduled tokens of all requests). Per layer kind:
L `MarathonLinearAttention` (vLLM-managed conv + fp32 recurrent state), S `MarathonSlidingAttention` (paged KV,
per-layer window), G `MarathonLatentAttention` (paged latent cache, MQA over the latent). Block attention
residuals and the layer wiring are `model.attn_residual`'s, as in `model.modeling`.

`load_weights` takes HF names (the safetensors checkpoint `model/` saves, or the learner's state dict for an
in-place update of a running engine) and returns the set of vLLM parameter names it filled.
Projections are plain `nn.Linear`: vLLM's CPU linear layers free their weight after prepacking it, which
would turn in-place updates into a re-pack of every layer.

Tensor parallelism (`tp.py`): heads of every attention kind, the dense / shared-expert FFN widths and the
routed experts' widths are split across TP ranks; parameters keep local shapes and each sharded one carries a
`weight_loader` that takes its slice of the FULL HF tensor, so checkpoints and learner updates (always full
tensors) load the same way at any TP size. A TP size that does not divide the heads or FFN widths is refused
(`tp.tp_problem`). Served MLA cache: the latent is cached twice per token (as key and as value), see
`attention.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.sequence import IntermediateTensors

from model.attn_residual import AttnResidualMix, ResidualWiring, run_layers
from model.config import MarathonConfig
from model.norm import RMSNorm  # the learner's cast order (weight applied in fp32), not vLLM's
from rollout.vllm_plugin.attention import MarathonLatentAttention, MarathonSlidingAttention
from rollout.vllm_plugin.linear_attention import MarathonLinearAttention, linear_state_dtypes, linear_state_shapes
from rollout.vllm_plugin import tp
from rollout.vllm_plugin.moe import MarathonMoE, ParallelSwiGLU

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class MarathonDecoderLayer(ResidualWiring, nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer_idx: int, prefix: str):
        super().__init__()
        config: MarathonConfig = vllm_config.model_config.hf_config
        self.kind = config.layer_kinds[layer_idx]
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps=eps)
        if self.kind == "L":
            self.self_attn = MarathonLinearAttention(config, vllm_config, layer_idx, f"{prefix}.self_attn")
        elif self.kind == "S":
            self.self_attn = MarathonSlidingAttention(config, vllm_config.cache_config, f"{prefix}.self_attn")
        else:
            self.self_attn = MarathonLatentAttention(config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(D, eps=eps)
        self.is_moe = layer_idx >= config.first_k_dense
        self.mlp = MarathonMoE(config, f"{prefix}.mlp") if self.is_moe else ParallelSwiGLU(D, config.intermediate_size)
        self.add_residual_mixes(config, layer_idx)

    def mix(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, x)

    def ffn(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.mlp(x), None

    def forward(self, positions, hidden, blocks):
        """As `model.modeling.DecoderLayer.forward`, on [N, D] tokens."""
        return self.ffn_half(self.mixer_half(hidden, blocks, positions), blocks)[0]


class MarathonModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: MarathonConfig = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            MarathonDecoderLayer(vllm_config, i, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.final_res = AttnResidualMix(config.hidden_size, config.rms_norm_eps) if config.attn_residual else None
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [N, D]
        return run_layers(self.layers, hidden, self.final_res, self.config.attn_residual_block_size,
                          lambda i, layer, stream, blocks: layer(positions, stream, blocks), self.norm)


class MarathonAttnForCausalLM(nn.Module):
    """A layout without linear (L) layers: vLLM allocates linear-attention state only for models declared
    hybrid, and a hybrid model without such layers is refused, so these layouts are served by this class
    (select it with ``hf_overrides={"architectures": [serving_architecture(config)]}``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: MarathonConfig = vllm_config.model_config.hf_config
        tp.check_tp(config, tp.tp_size())
        if ("L" in config.layer_kinds) != getattr(self, "is_hybrid", False):
            raise ValueError(
                f"layout {config.layer_layout!r} must be served as {serving_architecture(config)}, not "
                f"{type(self).__name__} (pass hf_overrides={{'architectures': [serving_architecture(config)]}})"
            )
        self.config = config
        self.model = MarathonModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=_join(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # --- weights -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names -> parameters/buffers, always through each tensor's weight loader: vLLM's in-place reload
        (`reload_weights`, used for learner updates) wraps those loaders to re-run post-load processing (CPU
        prepacking) per layer. Unknown names raise (a silently skipped tensor would serve stale weights).
        Returns the vLLM parameter names loaded."""
        tensors = {**dict(self.named_buffers()), **dict(self.named_parameters())}
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            if name.endswith("router.tokens_per_expert"):
                continue  # training statistic, not served
            m = _EXPERTS.match(name)
            if m:
                names = self.get_submodule(m.group(1)).load_expert_weight(m.group(2), tensor)
                loaded.update(f"{m.group(1)}.experts.{n}" for n in names)
                continue
            if name not in tensors:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the vLLM Marathon model")
            target = tensors[name]
            getattr(target, "weight_loader", default_weight_loader)(target, tensor)
            loaded.add(name)
        return loaded


class MarathonForCausalLM(MarathonAttnForCausalLM, HasInnerState, IsHybrid):
    """The hybrid model (the checkpoint's architecture): layouts with linear (L) layers."""

    # --- hybrid state declaration (one L layer's state per request) --------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        """One rank's shapes: the linear heads are split across tensor-parallel ranks."""
        config = vllm_config.model_config.hf_config
        ranks = vllm_config.parallel_config.tensor_parallel_size
        tp.check_tp(config, ranks)
        return linear_state_shapes(config, ranks)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return linear_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()


def serving_architecture(config: MarathonConfig) -> str:
    """The registered vLLM architecture that serves this config's layout."""
    return "MarathonForCausalLM" if "L" in config.layer_kinds else "MarathonAttnForCausalLM"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
