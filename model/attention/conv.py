"""Short causal depthwise convolution (kernel 4 in KDA) over q/k/v, with a carried state and packed-row resets."""

from __future__ import annotations

import torch
from torch import nn


class ShortConv(nn.Module):
    """Depthwise causal conv, no bias, SiLU after. ``weight`` [C, 1, W] is nn.Conv1d's (and fla's) layout."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None, pos_in_seg: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C]; state [B, W-1, C] (the previous W-1 inputs, fp32) or None (zeros).

        ``pos_in_seg`` [T] (packed rows): each token's index inside its own sequence; taps reaching across a
        sequence start are dropped. Returns (silu(conv(x)) [B, T, C], new state [B, W-1, C] fp32).
        """
        B, T, C = x.shape
        W = self.kernel
        prev = x.new_zeros(B, W - 1, C) if state is None else state.to(x.dtype)
        xp = torch.cat([prev, x], dim=1)  # [B, T+W-1, C]
        y = torch.zeros_like(x)
        for j in range(W):  # tap j looks (W-1-j) tokens back
            tap = xp[:, j : j + T] * self.weight[:, 0, j]
            if pos_in_seg is not None and j < W - 1:
                tap = tap * (pos_in_seg >= W - 1 - j).to(x.dtype)[None, :, None]
            y = y + tap
        return nn.functional.silu(y), xp[:, T:].float()
