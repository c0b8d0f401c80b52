"""RMSNorm (computed in fp32) and the gated RMSNorm on the linear-attention output (as in KDA)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """out = RMSNorm(x) * sigmoid(gate), per head (the norm runs over the last dim)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x).float() * torch.sigmoid(gate.float())).to(x.dtype)
