"""Rotary position embedding (rotate-half / NeoX convention) with a configurable base.

The base (`rope_theta`) is read from the config when the module is built, so a context-extension stage
changes it by loading the checkpoint with an overridden ``rope_theta``.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin) each [B, T, dim] fp32. No buffer: safe under meta-device loading."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids.device) / self.dim
        inv_freq = 1.0 / (self.theta**exponent)  # [dim/2]
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D] -> rotated x (same dtype), computed in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)).to(x.dtype)
