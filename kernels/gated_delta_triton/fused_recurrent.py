"""Decode: one token of the gated delta rule, fused (the recurrent step on an fp32 state)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_step_kernel(q, k, v, g, beta, state, o, new_state, scale, H: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr):
    """S = diag(exp(g)) S; S += beta k (v - S^T k)^T; o = S^T (scale q) for one (batch, head, V-slice)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + i_bh * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k).to(tl.float32)
    b_g = tl.load(g + i_bh * K + o_k).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v).to(tl.float32)
    b_b = tl.load(beta + i_bh).to(tl.float32)
    p_s = i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(state + p_s) * tl.exp(b_g)[:, None]  # [K, BV]
    b_delta = (b_v - tl.sum(b_k[:, None] * b_s, 0)) * b_b
    b_s += b_k[:, None] * b_delta[None, :]
    tl.store(o + i_bh * V + o_v, tl.sum((b_q * scale)[:, None] * b_s, 0))
    tl.store(new_state + p_s, b_s)


def gated_delta_rule_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused decode step, same contract as ``kernels.gated_delta.gated_delta_rule_step``:
    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] fp32 -> (o [B, H, V] fp32, new state).
    ``inplace`` overwrites ``state`` (the decode loop's usual mode)."""
    B, H, K = q.shape
    V = v.shape[-1]
    if state.dtype != torch.float32 or state.shape != (B, H, K, V) or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [B, H, K, V] = {(B, H, K, V)}, got "
                         f"{state.dtype} {tuple(state.shape)}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    scale = K**-0.5 if scale is None else scale
    o = torch.empty(B, H, V, device=q.device, dtype=torch.float32)
    new_state = state if inplace else torch.empty_like(state)
    BV = min(32, V)
    _decode_step_kernel[(V // BV, B * H)](q, k, v, g, beta, state, o, new_state, scale, H, K, V, BV)
    return o, new_state
