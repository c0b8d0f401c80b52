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
from model.attention.conv import ShortConv
from model.config import MarathonConfig
from model.norm import GatedRMSNorm


class LinearAttention(nn.Module):
    def __init__(self, config: MarathonConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.linear_num_heads
        K, V = config.linear_head_k_dim, config.linear_head_v_dim
        self.num_heads, self.head_k_dim, self.head_v_dim = H, K, V
        self.gate_fn, self.g_min = config.linear_gate_fn, config.linear_g_min
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
        """x [B, T, D] -> the decay pre-activation f_b(f_a(x)) + dt_bias [B, T, H, K] fp32."""
        B, T, _ = x.shape
        raw = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        return raw.view(B, T, self.num_heads, self.head_k_dim)

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> exp(A_log) * raw [B, T, H, K] fp32, the bounded gate's argument (g = g_min * sigmoid(.))."""
        return self.A_log.float().exp()[:, None] * self._raw(x)  # [H, 1] * [B, T, H, K]

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> log-decay g [B, T, H, K] fp32 (<= 0)."""
        if self.gate_fn == "bounded":
            return self.g_min * torch.sigmoid(self.gate_logits(x))
        return -self.A_log.float().exp()[:, None] * F.softplus(self._raw(x))

    def forward(self, x, cache=None, pos_in_seg=None, cu_seqlens=None, token_mask=None):
        """x [B, T, D] -> [B, T, D].

        cache: this layer's `LinearStateCache` (conv + recurrent state, fp32) or None. cu_seqlens/pos_in_seg:
        packed B=1 rows (states reset at each boundary). token_mask [B, T] (1 = real, 0 = left padding):
        padded tokens get zero input, beta = 0 and g = 0 so they leave every state untouched.
        """
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        if token_mask is not None:
            x = x * token_mask[..., None].to(x.dtype)
        conv = cache.conv_states if cache is not None else {}
        q, conv_q = self.q_conv1d(self.q_proj(x), conv.get("q"), pos_in_seg)
        k, conv_k = self.k_conv1d(self.k_proj(x), conv.get("k"), pos_in_seg)
        v, conv_v = self.v_conv1d(self.v_proj(x), conv.get("v"), pos_in_seg)
        q = F.normalize(q.view(B, T, H, K).float(), dim=-1, eps=1e-6).to(x.dtype)  # [B, T, H, K]
        k = F.normalize(k.view(B, T, H, K).float(), dim=-1, eps=1e-6).to(x.dtype)
        v = v.view(B, T, H, V)
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]
        if token_mask is not None:
            beta = beta * token_mask[..., None]
        state = cache.recurrent_state if cache is not None else None
        if T == 1 and state is not None:
            g = self.decay(x)  # [B, 1, H, K] fp32
            if token_mask is not None:
                g = g * token_mask[..., None, None]
            o, state = kernels.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o.unsqueeze(1).to(x.dtype)  # [B, 1, H, V]
        else:
            # the bounded gate goes into the kernel as logits (fused with its chunk cumsum); -inf logits give
            # g = 0 for padded tokens
            fused = self.gate_fn == "bounded" and self.g_min >= -5  # the Triton kernel takes g >= -5
            g = self.gate_logits(x) if fused else self.decay(x)  # [B, T, H, K] fp32
            if token_mask is not None:
                g = g.masked_fill(token_mask[..., None, None] == 0, float("-inf") if fused else 0.0)
            o, state = kernels.gated_delta_rule(
                q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
                bounded_gate=fused, gate_lower_bound=self.g_min if fused else None,
            )  # o [B, T, H, V]; state [B or N, H, K, V] fp32
        if cache is not None:
            cache.conv_states = {"q": conv_q, "k": conv_k, "v": conv_v}
            cache.recurrent_state = state
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, V)
        o = self.o_norm(o.to(x.dtype), gate)  # [B, T, H, V]
        return self.o_proj(o.reshape(B, T, H * V))
