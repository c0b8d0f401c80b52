"""KDA-style linear attention: the gated delta rule with per-channel decay (L layers).

    q, k, v = silu(shortconv(W x))        q, k L2-normalised per head
    raw     = f_b(f_a(x)) + dt_bias       low-rank decay projection, per channel [H, K]
    g       = g_min * sigmoid(exp(A_log) * raw)      ("bounded", g_min = -5: the safe-gate form)
            | -exp(A_log) * softplus(raw)            ("softplus", KDA's original)
    beta    = sigmoid(b_proj x)           [H]
    o       = delta_rule(q, k, v, g, beta)           state [B, H, K, V] fp32
    out     = o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))

Parameter names follow Kimi Linear / fla's KimiDeltaAttention so serving code can map them one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.gated_delta_segmented import state_passing_segments
from model import chunking
from model.attention.conv import ShortConv
from model.chunking import over_tokens
from model.config import MarathonConfig
from model.norm import GatedRMSNorm


class LinearAttention(nn.Module):
    """The set-up and math (gate, beta, q/k/v heads, output) are also the vLLM plugin's: it subclasses this with
    its tensor-parallel rank's ``num_heads`` and runs its own token layout and state slots in ``forward``."""

    def __init__(self, config: MarathonConfig, layer_idx: int, num_heads: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = config.hidden_size, num_heads or config.linear_num_heads
        K, V = config.linear_head_k_dim, config.linear_head_v_dim
        self.num_heads, self.head_k_dim, self.head_v_dim = H, K, V
        self.gate_fn, self.g_min = config.linear_gate_fn, config.linear_g_min
        # the bounded gate goes into the chunked kernel as logits (fused with its chunk cumsum); the Triton
        # kernel takes g >= -5
        self.fused_gate = self.gate_fn == "bounded" and self.g_min >= -5
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.q_conv1d = ShortConv(H * K, config.linear_conv_kernel)
        self.k_conv1d = ShortConv(H * K, config.linear_conv_kernel)
        self.v_conv1d = ShortConv(H * V, config.linear_conv_kernel)
        self.f_a_proj = nn.Linear(D, K, bias=False)  # low-rank decay projection
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(self._dt_bias_init(H * K))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, V, bias=False)  # low-rank output gate
        self.g_b_proj = nn.Linear(V, H * V, bias=False)
        self.o_norm = GatedRMSNorm(V, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    @staticmethod
    def _dt_bias_init(n: int) -> torch.Tensor:
        """Mamba-style: softplus(dt_bias) spread log-uniformly over [1e-3, 0.1]."""
        dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the decay pre-activation f_b(f_a(x)) + dt_bias [..., H, K] fp32."""
        raw = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        return raw.unflatten(-1, (self.num_heads, self.head_k_dim))

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> exp(A_log) * raw [..., H, K] fp32, the bounded gate's argument (g = g_min * sigmoid(.))."""
        return self.A_log.float().exp()[:, None] * self._raw(x)  # [H, 1] * [..., H, K]

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> log-decay g [..., H, K] fp32 (<= 0)."""
        if self.gate_fn == "bounded":
            return self.g_min * torch.sigmoid(self.gate_logits(x))
        return -self.A_log.float().exp()[:, None] * F.softplus(self._raw(x))

    def chunk_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the gate `chunked` takes [..., H, K] fp32: the logits for the fused gate, else g."""
        return self.gate_logits(x) if self.fused_gate else self.decay(x)

    def chunked(self, q, k, v, g, beta, **kwargs):
        """`kernels.gated_delta_rule` as this layer calls it, with g from `chunk_gate`."""
        return kernels.gated_delta_rule(q, k, v, g, beta, bounded_gate=self.fused_gate,
                                        gate_lower_bound=self.g_min if self.fused_gate else None, **kwargs)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the delta rule's write strength sigmoid(b_proj x) [..., H] fp32."""
        return torch.sigmoid(self.b_proj(x).float())

    def conv_heads(self, q, k, v, states=(None, None, None), pos_in_seg=None):
        """Projected q, k [B, T, H*K], v [B, T, H*V] through the short convs (``states``: theirs, [B, W-1, C] or
        None, ``pos_in_seg`` as `ShortConv`) -> q, k L2-normalised [B, T, H, K] and v [B, T, H, V] in v's dtype,
        and the new conv states (q, k, v) [B, W-1, C] fp32."""
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        (q, sq), (k, sk), (v, sv) = (conv(t, s, pos_in_seg) for conv, t, s in zip(convs, (q, k, v), states))
        q = F.normalize(q.unflatten(-1, (H, K)).float(), dim=-1, eps=1e-6).to(v.dtype)
        k = F.normalize(k.unflatten(-1, (H, K)).float(), dim=-1, eps=1e-6).to(v.dtype)
        return q, k, v.unflatten(-1, (H, V)), (sq, sk, sv)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The delta rule's o [..., H, V] and the layer input x [..., D] -> o_proj(RMSNorm(o) * sigmoid(gate)) [..., D]."""
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.head_v_dim))
        o = self.o_norm(o.to(x.dtype), gate)  # [..., H, V]
        return self.o_proj(o.flatten(-2))

    def forward(self, x, cache=None, pos_in_seg=None, cu_seqlens=None, token_mask=None):
        """x [B, T, D] -> [B, T, D].

        cache: this layer's `LinearStateCache` (conv + recurrent state, fp32) or None. cu_seqlens/pos_in_seg:
        packed B=1 rows (states reset at each boundary). token_mask [B, T] (1 = real, 0 = left padding):
        padded tokens get zero input, beta = 0 and g = 0 so they leave every state untouched.

        Without a cache, a B = 1 row longer than ``model.chunking.TOKEN_CHUNK`` runs the whole layer that many
        tokens at a time, the recurrent state carried across the cuts (`_segmented`); other long rows run the
        token-local parts before and after the kernel in token chunks (`model.chunking.over_tokens`).
        """
        if token_mask is not None:
            x = x * token_mask[..., None].to(x.dtype)
        if cache is None and x.shape[0] == 1 and token_mask is None and x.shape[1] > chunking.TOKEN_CHUNK:
            return self._segmented(x, pos_in_seg, cu_seqlens)
        if cache is None:
            q, k, v, g, beta = over_tokens(self._kernel_inputs, x, pos_in_seg, token_mask,
                                           halo=self.q_conv1d.kernel - 1)
            o, _ = self.chunked(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)
            return over_tokens(self.output, o, x)
        state = cache.recurrent_state
        step = x.shape[1] == 1 and state is not None  # one token on a recurrent state
        q, k, v, g, beta = self._kernel_inputs(x, pos_in_seg, token_mask, cache, step)
        if step:
            o, state = kernels.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o.unsqueeze(1)  # [B, 1, H, V]
        else:
            o, state = self.chunked(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                    cu_seqlens=cu_seqlens)  # o [B, T, H, V]; state [B or N, H, K, V] fp32
        cache.recurrent_state = state
        return self.output(o, x)

    def _segmented(self, x: torch.Tensor, pos_in_seg: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """x [1, T, D] -> [1, T, D], ``TOKEN_CHUNK`` tokens at a time (`kernels.state_passing_segments`): each
        segment's projections, short convs (reading W-1 tokens of halo), kernel and output gate, from the state
        the previous segment handed on. Only x and the output span the row; the backward recomputes one segment
        at a time. At 1M tokens this takes a KDA layer's recompute + backward from ~68 GiB (whole-row q/k/v/gate
        and their gradients, the kernel's intermediates per 64K) to a segment's (benchmarks/learner/h200).
        The parameters' gradients accumulate into their ``.grad`` during the backward (as under reentrant
        checkpointing): train with ``.backward()``; ``torch.autograd.grad`` on them does not see this path."""
        T = x.shape[1]
        bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        h0 = x.new_zeros(len(bounds) - 1, self.num_heads, self.head_k_dim, self.head_v_dim, dtype=acc)
        tensors = [x] if pos_in_seg is None else [x, pos_in_seg[None]]
        out, _ = state_passing_segments(self._segment, tensors, h0, bounds, chunking.TOKEN_CHUNK,
                                        halo=self.q_conv1d.kernel - 1)
        return out

    def _segment(self, x, pos=None, *, initial_state, cu_seqlens, halo):
        """One segment for `_segmented`: x [1, h + n, D] (h = ``halo`` tokens before it), pos [1, h + n] or None
        -> (out [1, n, D], final states [N_seg, H, K, V])."""
        q, k, v, g, beta = (t[:, halo:] for t in self._kernel_inputs(x, None if pos is None else pos[0]))
        o, state = self.chunked(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                cu_seqlens=cu_seqlens)
        return self.output(o, x[:, halo:]), state

    def _kernel_inputs(self, x, pos_in_seg=None, token_mask=None, cache=None, step=False):
        """The (masked) layer input x [B, T, D] -> the kernel's q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K]
        fp32 (`decay` for a recurrent ``step``, else `chunk_gate`), beta [B, T, H] fp32. Token-local but for the
        short convs' W-1 taps back; with a ``cache``, its conv states are read and replaced."""
        conv = cache.conv_states if cache is not None else {}
        q, k, v, conv_states = self.conv_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x),
                                               (conv.get("q"), conv.get("k"), conv.get("v")), pos_in_seg)
        if cache is not None:
            cache.conv_states = dict(zip("qkv", conv_states))
        beta = self.beta(x)  # [B, T, H]
        g = self.decay(x) if step else self.chunk_gate(x)  # [B, T, H, K] fp32
        if token_mask is not None:
            beta = beta * token_mask[..., None]
            if step:
                g = g * token_mask[..., None, None]
            else:  # -inf logits give g = 0 for padded tokens
                g = g.masked_fill(token_mask[..., None, None] == 0, float("-inf") if self.fused_gate else 0.0)
        return q, k, v, g, beta
