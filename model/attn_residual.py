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
import torch.nn.functional as F
from torch import nn


class AttnResidualMix(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden))

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: n tensors [B, T, D] -> their mix [B, T, D]."""
        if len(sources) == 1:
            return sources[0]
        V = torch.stack(sources, dim=0)  # [n, B, T, D]
        keys = F.rms_norm(V.float(), (V.shape[-1],), eps=self.eps)
        alpha = (keys @ self.query.float()).softmax(dim=0)  # [n, B, T]
        return (alpha.unsqueeze(-1) * V.float()).sum(0).to(V.dtype)
