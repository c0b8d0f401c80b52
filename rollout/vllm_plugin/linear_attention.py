"""KDA-style linear attention (L layers) as a vLLM state layer.

vLLM owns the per-request state (`MambaBase`: one state slot per running request, allocated by the hybrid
KV-cache manager, batch metadata from the GDN backend): a conv state [W-1, 2HK+HV] (model dtype: the last
W-1 projected q|k|v inputs) and the recurrent state [H, K, V] in fp32 (H: this rank's linear_num_heads / tp). The math is `model.attention.linear`'s,
through the same kernels: `kernels.gated_delta_rule` (chunked) for prefill chunks, `kernels.gated_delta_rule_step`
for decode tokens, so the server's logprobs match the learner's forward.

Exact mode (``linear_exact_decode: true`` in the HF config, e.g. ``hf_overrides={"linear_exact_decode": True}``):
every token, prefill or decode, goes through `kernels.chunk_replay`: the recurrent state slot [H, K*V + 63*F] fp32
holds the fp32 state at the last 64-token chunk boundary of the sequence and the tail, the inputs of the (< 64)
tokens since it (F = 3K+V+1 per head and token). One tensor, so vLLM's state copies (prefix caching's 'align'
mode moves a request's state between slots) carry the tail with the state. The linear layers' outputs then equal the learner's whole-sequence chunked forward bit
for bit (the recurrent step and mid-chunk prefills round differently: drift that grows with context); decoding
costs a replay of up to 64 tokens per layer and step.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

import kernels
from kernels.chunk_replay import CHUNK_SIZE, chunk_replay_decode, tail_width
from model.attention.linear import LinearAttention
from model.config import MarathonConfig
from rollout.vllm_plugin import tp


def exact_decode(config: MarathonConfig) -> bool:
    """Exact mode (module docstring): set by ``linear_exact_decode`` in the served HF config."""
    return bool(getattr(config, "linear_exact_decode", False))


def linear_state_shapes(config: MarathonConfig, tp: int = 1) -> tuple[tuple[int, ...], ...]:
    """(conv state shape, recurrent state shape) of one L layer for one request on one of ``tp`` tensor-parallel
    ranks (H = linear_num_heads / tp local heads); exact mode: the recurrent state [H, K*V] and the tail
    [H, 63 * F] side by side."""
    H, K, V = config.linear_num_heads // tp, config.linear_head_k_dim, config.linear_head_v_dim
    conv = MambaStateShapeCalculator._orient_conv_shape(2 * H * K + H * V, config.linear_conv_kernel - 1)
    if exact_decode(config):
        return conv, (H, K * V + (CHUNK_SIZE - 1) * tail_width(K, V))
    return conv, (H, K, V)


def linear_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """Conv state in the model dtype (it holds model-dtype inputs), recurrent state fp32 unless overridden
    (exact mode needs fp32: it holds the learner's chunk-boundary state and the tail)."""
    cache = vllm_config.cache_config
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(
        vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )
    if exact_decode(vllm_config.model_config.hf_config) and dtypes[1] != torch.float32:
        raise ValueError(f"linear_exact_decode needs the fp32 recurrent state, got mamba_ssm_cache_dtype={cache.mamba_ssm_cache_dtype!r}")
    return dtypes


class MarathonLinearAttention(LinearAttention, MambaBase):
    """`model.attention.linear.LinearAttention` with this rank's heads: its parameters (names too, so checkpoints
    load 1:1) and math; ``forward`` runs vLLM's token layout and state slots.

    Tensor parallelism: each rank runs H = linear_num_heads / tp heads end to end (their q/k/v, conv channels,
    decay and beta, state [H, K, V], gated norm), and o_proj's partial sums are all-reduced. The low-rank
    f_a / g_a projections (D -> K, D -> V) are shared by all heads and replicated."""

    def __init__(self, config: MarathonConfig, vllm_config: VllmConfig, layer_idx: int, prefix: str):
        ranks = tp.tp_size()
        super().__init__(config, layer_idx, config.linear_num_heads // ranks)
        self.tp = ranks
        self.prefix = prefix
        self.vllm_config = vllm_config
        self.config = config
        tp.column(self.q_proj, self.k_proj, self.v_proj, self.q_conv1d, self.k_conv1d, self.v_conv1d,
                  self.f_b_proj, self.A_log, self.dt_bias, self.b_proj, self.g_b_proj)
        tp.row(self.o_proj)

        self.exact = exact_decode(config)
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name: {prefix}")
        ctx[prefix] = self

    # --- vLLM state declaration -------------------------------------------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN  # its metadata: decodes first, per-request state slots

    def get_state_shape(self):
        return linear_state_shapes(self.config, self.tp)

    def get_state_dtype(self):
        return linear_state_dtypes(self.vllm_config)

    # --- forward ----------------------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [N], x [N, D] (all requests' tokens, decodes first) -> [N, D]."""
        o = x.new_zeros(x.shape[0], self.num_heads, self.head_v_dim)  # [N, H, V]
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is not None and meta.num_actual_tokens > 0:  # None: profiling / warm-up runs
            if meta.spec_sequence_masks is not None:
                raise NotImplementedError("speculative decoding is not supported by the Marathon plugin")
            n = meta.num_actual_tokens
            o[:n] = self._mix(x[:n], positions[:n], meta)
        return tp.all_reduce(self.output(o, x))  # [N, D]: the ranks' heads summed

    def _mix(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Token mixing with vLLM-held states. x [n, D], positions [n] -> o [n, H, V] in x.dtype."""
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        conv_cache, rec_cache = self.kv_cache  # [slots, W-1, C] (or [slots, C, W-1]), [slots, H, K, V] fp32
        if is_conv_state_dim_first():
            conv_cache = conv_cache.transpose(-1, -2)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        g = self.chunk_gate(x) if self.exact else self.decay(x)  # [n, H, K] fp32
        beta = self.beta(x)  # [n, H]
        bounds = meta.non_spec_query_start_loc.tolist()
        has_init = meta.has_initial_state
        slots = meta.non_spec_state_indices_tensor.long()
        nd, npf = meta.num_decodes, meta.num_prefills
        out = x.new_empty(x.shape[0], H, V)
        if nd:
            idx = slots[:nd]
            qd, kd, vd = self._conv(q[:nd, None], k[:nd, None], v[:nd, None], conv_cache, idx, conv_cache[idx])
            if self.exact:  # every decode through the chunk replay, in one call
                out[:nd] = self._replay_decodes(qd[:, 0], kd[:, 0], vd[:, 0], g[:nd], beta[:nd], idx,
                                                positions[:nd].tolist()).to(x.dtype)
            else:
                o, state = kernels.gated_delta_rule_step(qd[:, 0], kd[:, 0], vd[:, 0], g[:nd], beta[:nd], rec_cache[idx])
                rec_cache[idx] = state.to(rec_cache.dtype)
                out[:nd] = o.to(x.dtype)
        for r in range(nd, nd + npf):  # prefill chunks, one request at a time (as the HF model runs them)
            lo, hi = bounds[r], bounds[r + 1]
            idx = slots[r : r + 1]
            fresh = has_init is None or not bool(has_init[r])
            qp, kp, vp = self._conv(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], conv_cache, idx, None if fresh else conv_cache[idx])
            if self.exact:
                o = self._replay(qp, kp, vp, g[None, lo:hi], beta[None, lo:hi], int(idx), int(positions[lo]), fresh)
            else:
                init = None if fresh else rec_cache[idx]
                o, state = kernels.gated_delta_rule(
                    qp, kp, vp, g[None, lo:hi], beta[None, lo:hi], initial_state=init, output_final_state=True
                )
                rec_cache[idx] = state.to(rec_cache.dtype)
            out[lo:hi] = o[0].to(x.dtype)
        return out

    def _exact_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact mode's views of state slots [n]: boundary states [n, H, K, V] and tails [n, C-1, H, F] (copies)."""
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        rec = self.kv_cache[1][slots]  # [n, H, K*V + (C-1)*F]
        tails = rec[..., K * V :].unflatten(-1, (CHUNK_SIZE - 1, -1)).transpose(1, 2)  # [n, C-1, H, F]
        return rec[..., : K * V].unflatten(-1, (K, V)), tails

    def _store_slot(self, slot: int, state: torch.Tensor | None, tail: torch.Tensor) -> None:
        """Writes one request's boundary state [H, K, V] (None: the zero initial state) and tail [r, H, F]."""
        K, V = self.head_k_dim, self.head_v_dim
        rec = self.kv_cache[1][slot]  # [H, K*V + (C-1)*F]
        rec[:, : K * V] = 0.0 if state is None else state.flatten(-2)
        rec[:, K * V :].unflatten(-1, (CHUNK_SIZE - 1, -1))[:, : tail.shape[0]] = tail.transpose(0, 1)

    def _replay(self, q, k, v, g, beta, slot: int, start: int, fresh: bool) -> torch.Tensor:
        """One request's new tokens (q, k, g [1, n, H, K], v [1, n, H, V], beta [1, n, H]; the first at sequence
        position ``start``) through `kernels.chunk_replay` with this slot's boundary state and tail. -> o [1, n, H, V]."""
        if fresh and start:
            raise RuntimeError(f"linear_exact_decode: a request resumed at position {start} without its state")
        state, tails = self._exact_slots(torch.tensor([slot]))
        r = start % CHUNK_SIZE  # tokens since the last chunk boundary
        o, state, tail = kernels.chunk_replay(self.chunked, q, k, v, g, beta, None if fresh else state, tails[0, :r])
        self._store_slot(slot, None if state is None else state[0], tail)
        return o

    def _replay_decodes(self, q, k, v, g, beta, slots: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """One token for each of n decoding requests (q, k, g [n, H, K], v [n, H, V], beta [n, H], at positions
        ``starts``) through `kernels.chunk_replay_decode`. -> o [n, H, V]."""
        states, tails = self._exact_slots(slots)
        tails = [t[: p % CHUNK_SIZE] for t, p in zip(tails, starts)]
        o, states, tails = chunk_replay_decode(self.chunked, q, k, v, g, beta, states, tails)
        for slot, state, tail in zip(slots.tolist(), states, tails):
            self._store_slot(slot, state, tail)
        return o

    def _conv(self, q, k, v, conv_cache, idx, state):
        """q, k [B, T, HK], v [B, T, HV]; state [B, W-1, C] or None -> `conv_heads`' q, k [B, T, H, K],
        v [B, T, H, V]; writes the new conv states to conv_cache[idx]."""
        HK = q.shape[-1]
        states = (None, None, None) if state is None else state.split([HK, HK, v.shape[-1]], dim=-1)
        q, k, v, new = self.conv_heads(q, k, v, states)
        conv_cache[idx] = torch.cat(new, dim=-1).to(conv_cache.dtype)
        return q, k, v
