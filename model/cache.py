"""`MarathonCache`: per-layer decoding state for the hybrid layout, a transformers `Cache` so that
`model.generate` carries it between steps.

Per layer kind, per sequence:
    L  LinearStateCache   conv states q/k/v [B, W-1, C] + recurrent state [B, H, K, V], all fp32, O(1) in T
    S  SlidingKVCache     keys/values [B, Hkv, <= window-1, head_dim] in the model dtype
    G  LatentCache        latent [B, T, kv_lora_rank] + rope key [B, T, qk_rope_head_dim], model dtype
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from model.config import MarathonConfig


class _LayerCache:
    def __init__(self):
        self.seen = 0  # tokens processed before the current forward (set by MarathonCache.advance)

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def map_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            self._set(name, fn(t))

    def _set(self, name: str, t: torch.Tensor) -> None:
        setattr(self, name, t)


class LinearStateCache(_LayerCache):
    def __init__(self):
        super().__init__()
        self.conv_states: dict[str, torch.Tensor] = {}
        self.recurrent_state: torch.Tensor | None = None

    def tensors(self):
        out = {f"conv_{k}": v for k, v in self.conv_states.items()}
        if self.recurrent_state is not None:
            out["recurrent_state"] = self.recurrent_state
        return out

    def _set(self, name, t):
        if name.startswith("conv_"):
            self.conv_states[name[5:]] = t
        else:
            self.recurrent_state = t


class SlidingKVCache(_LayerCache):
    def __init__(self):
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, T, hd] -> (past + new) keys/values; stores only the last `keep` tokens."""
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.keys, self.values = k[:, :, -keep:], v[:, :, -keep:]
        return k, v

    def tensors(self):
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}


class LatentCache(_LayerCache):
    def __init__(self):
        super().__init__()
        self.latent: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None

    def update(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [B, T, r], k_pe [B, T, rope] -> all tokens so far."""
        if self.latent is not None:
            c_kv, k_pe = torch.cat([self.latent, c_kv], dim=1), torch.cat([self.k_rope, k_pe], dim=1)
        self.latent, self.k_rope = c_kv, k_pe
        return c_kv, k_pe

    def tensors(self):
        return {} if self.latent is None else {"latent": self.latent, "k_rope": self.k_rope}


_KIND_TO_CACHE = {"L": LinearStateCache, "S": SlidingKVCache, "G": LatentCache}


class MarathonCache(Cache):
    """One `_LayerCache` per decoder layer. The model calls `advance(T)` after each forward."""

    def __init__(self, config: MarathonConfig):
        super().__init__(layers=[_KIND_TO_CACHE[kind]() for kind in config.layer_kinds])
        self.seen_tokens = 0

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens
        for layer in self.layers:
            layer.seen = self.seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by all cached tensors (what `marathon bench memory` predicts)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors().values())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.map_(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.map_(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.map_(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("recurrent and sliding states cannot be rolled back")

    def reset(self) -> None:
        for i, layer in enumerate(self.layers):
            self.layers[i] = type(layer)()
        self.seen_tokens = 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [isinstance(layer, SlidingKVCache) for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, LinearStateCache) for layer in self.layers]

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            for t in layer.tensors().values():
                return t.shape[0]
        return -1
