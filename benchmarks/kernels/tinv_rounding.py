"""What storing Tinv = (I + Akk)^-1 in bf16 adds to the kernel's gradient errors: an fp64 study on the CPU.

The Triton kernel keeps Tinv in the inputs' dtype (kernels/gated_delta_triton/chunk.py). Its forward and the
value-gradient kernel cast Tinv to 16 bits before and after that change; the state-side and dAkk kernels
(dx = Tinv^T dw, dAkk = -Tinv^T dT Tinv^T) read fp32 Tinv before it and the 16-bit one after. This script runs
one 64-token chunk per (row, head) with a random initial state, everything in fp64 except Tinv's rounding, both
ways, and prints each gradient's norm-relative change beside the error bf16 inputs cause (the scale of every bf16
error the GPU accuracy check measures):

    python benchmarks/kernels/tinv_rounding.py --gate-mean 0 --gate-std 1   # the kernel bench's gate logits
    python benchmarks/kernels/tinv_rounding.py --gate-mean -10 --gate-std 1  # decays near 1: the largest Akk
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

F64 = torch.float64
C = 64  # the kernel's chunk
NAMES = ["dq", "dk", "dv", "dgate", "dbeta", "dh0"]


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(F64)


class WY(torch.autograd.Function):
    """(W, U) = (Tr x, Tr bv), Tr = bf16(Tinv), Tinv = (I + A)^-1; the backward reads Tr in the value gradient
    and, in ``read`` = "bf16", also in dx and dA (the exact Tinv there in ``read`` = "fp32")."""

    @staticmethod
    def forward(ctx, A, x, bv, read):
        Tinv = torch.linalg.inv(torch.eye(C, dtype=F64) + A)
        Tr = bf16(Tinv)
        ctx.save_for_backward(Tinv, Tr, x, bv)
        ctx.read = read
        return Tr @ x, Tr @ bv

    @staticmethod
    def backward(ctx, dW, dU):
        Tinv, Tr, x, bv = ctx.saved_tensors
        Tb = Tr if ctx.read == "bf16" else Tinv
        dT = dU @ bv.mT + dW @ x.mT
        return torch.tril(-(Tb.mT @ dT @ Tb.mT), -1), Tb.mT @ dW, Tr.mT @ dU, None


def decays(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's cumulative log-decay G = cumsum(-5 sigmoid(raw)) [..., C, K] and the pair decays
    exp(G_t - G_s) for s <= t, zero above [..., C, C, K]."""
    G = (-5 * torch.sigmoid(raw)).cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    return G, (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()


def akk(k: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Akk[t, s] = beta_t sum_c k_t k_s exp(G_t - G_s) for s < t, zero elsewhere. [..., C, C]"""
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    return torch.einsum("...tk,...sk,...tsk->...ts", k, k, decay) * beta[..., None] * strict


def gradients(inputs: list[torch.Tensor], read: str) -> tuple[torch.Tensor, ...]:
    """Gradients of <o, do> + <S1, dS> for one chunk per (row, head): q, k, v, raw [B, H, C, K], beta [B, H, C],
    S0 [B, H, K, K]."""
    q, k, v, raw, beta, S0 = [t.clone().requires_grad_() for t in inputs]
    G, decay = decays(raw)
    A = akk(k, beta, decay)
    Aqk = torch.einsum("...tk,...sk,...tsk->...ts", q, k, decay)
    W, U = WY.apply(A, beta[..., None] * k * G.exp(), beta[..., None] * v, read)
    u = U - W @ S0
    o = q.shape[-1] ** -0.5 * ((q * G.exp()) @ S0 + Aqk @ u)
    GL = G[..., -1, :]
    S1 = GL.exp()[..., None] * S0 + (k * (GL[..., None, :] - G).exp()).mT @ u
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum()
    loss = loss + (S1 * torch.randn(S1.shape, generator=gen, dtype=F64)).sum()
    return torch.autograd.grad(loss, (q, k, v, raw, beta, S0))


def chunk_inputs(rows: int, heads: int, head_dim: int, gate_mean: float, gate_std: float) -> list[torch.Tensor]:
    """q, k (unit rows), v, gate logits ~ N(gate_mean, gate_std^2) [rows, heads, C, head_dim], beta [rows, heads, C]
    and the initial state [rows, heads, head_dim, head_dim], fp64 (seeded)."""
    torch.manual_seed(0)
    shape = (rows, heads, C, head_dim)
    x = lambda *s: torch.randn(s, dtype=F64)  # noqa: E731
    return [F.normalize(x(*shape), dim=-1), F.normalize(x(*shape), dim=-1), x(*shape),
            gate_std * x(*shape) + gate_mean, torch.sigmoid(x(*shape[:3])), x(rows, heads, head_dim, head_dim)]


def changes(inputs: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """{gradient: (norm-relative change when the backward reads Tinv in bf16, norm-relative change from rounding
    the inputs to bf16)}, both against the fp32 read on the unrounded inputs."""
    fp32_read, bf16_read = gradients(inputs, "fp32"), gradients(inputs, "bf16")
    rounded = gradients([bf16(t) for t in inputs[:5]] + inputs[5:], "fp32")
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()  # noqa: E731
    return {name: (rel(b, f), rel(r, f)) for name, b, f, r in zip(NAMES, bf16_read, fp32_read, rounded)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gate-mean", type=float, default=0.0, help="mean of the gate logits (g = -5 sigmoid(logit))")
    p.add_argument("--gate-std", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    print(f"gate logits ~ N({a.gate_mean}, {a.gate_std}^2): norm-relative changes of each gradient")
    print("grad    Tinv read in bf16 vs fp32    bf16 inputs vs fp64 inputs")
    for name, (change, scale) in changes(chunk_inputs(a.rows, a.heads, a.head_dim, a.gate_mean, a.gate_std)).items():
        print(f"{name:6s}  {change:27.2e}    {scale:26.2e}")


if __name__ == "__main__":
    main()
