"""Gated delta rule (KDA-style) linear attention: plain PyTorch reference paths.

Recurrence per head, with a per-channel log-decay ``g`` (<= 0) and a write strength ``beta`` in (0, 1):

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

Shapes used throughout ``kernels/``:
    q, k : [B, T, H, K]   (the caller L2-normalises q and k)
    v    : [B, T, H, V]
    g    : [B, T, H, K]   log-space decay, <= 0
    beta : [B, T, H]
    state: [B, H, K, V]   always fp32
"""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Naive token-by-token reference. Computes in fp32 (fp64 for fp64 inputs), returns ``o`` in ``v``'s dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    out = []
    for t in range(T):
        o_t, state = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale)
        out.append(o_t)
    o = torch.stack(out, dim=1).to(v.dtype)  # [B, T, H, V]
    return o, (state if output_final_state else None)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step. q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state: [B, H, K, V] fp32.

    Returns (o [B, H, V] in fp32, new state [B, H, K, V] fp32; fp64 for fp64 inputs). The state stays fp32
    so the rollout engine's recurrent decode matches the learner's chunked forward.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(state.dtype, torch.float32)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    state = state * g.exp().unsqueeze(-1)  # decay each key channel
    pred = torch.einsum("bhk,bhkv->bhv", k, state)  # S^T k
    delta = (v - pred) * beta.unsqueeze(-1)  # [B, H, V]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)  # rank-1 write
    o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o, state
