"""Block attention residuals (arXiv 2603.15031), per DESIGN_NOTES.

Layers are grouped into blocks of `attn_residual_block_size`. Inside a block the outputs of the sublayers
(attention, then MLP, of every layer) are summed into a partial block output. The input of each sublayer is
a softmax mix over depth of the completed block outputs b_0..b_{n-1} (b_0 = the embedding) and the current
partial block:

    h = sum_i alpha_i v_i,    alpha = softmax_i(w . RMSNorm(v_i))

w is the sublayer's learned query, zero-initialised (a uniform mix at start); the key norm has no weight of
its own (it would only rescale w). Memory: O(N_blocks * d) per token instead of O(L * d).
"""

from __future__ import annotations

import torch
from torch import nn


class AttnResidualMix(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: n tensors [B, T, D] -> their mix [B, T, D].

        Computed source by source, without stacking them or their normalised copies ([n, B, T, D] each):
        w . RMSNorm(v) = (w . v) * rsqrt(mean(v^2) + eps), so the backward keeps only the sources themselves
        (alive anyway as block outputs) and [n, B, T] statistics. Equal to the stacked form up to rounding."""
        if len(sources) == 1:
            return sources[0]
        w = self.query.float()
        logits = torch.stack([self._logit(v.float(), w) for v in sources])  # [n, B, T]
        alpha = logits.softmax(dim=0)
        out = alpha[0, ..., None] * sources[0].float()
        for a, v in zip(alpha[1:], sources[1:]):
            out = out + a[..., None] * v.float()
        return out.to(sources[0].dtype)

    def _logit(self, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """w . RMSNorm(v) for v [B, T, D] fp32 -> [B, T]."""
        return (v @ w) * torch.rsqrt(v.square().mean(-1) + self.eps)
