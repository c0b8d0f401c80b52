"""Block attention residuals (arXiv 2603.15031), per DESIGN_NOTES.

Layers are grouped into blocks of `attn_residual_block_size`. Inside a block the outputs of the sublayers
(attention, then MLP, of every layer) are summed into a partial block output. The input of each sublayer is
a softmax mix over depth of the completed block outputs b_0..b_{n-1} (b_0 = the embedding) and the current
partial block:

    h = sum_i alpha_i v_i,    alpha = softmax_i(w . RMSNorm(v_i))

w is the sublayer's learned query, zero-initialised (a uniform mix at start); the key norm has no weight of
its own (it would only rescale w). Memory: O(N_blocks * d) per token instead of O(L * d).

`ResidualWiring` (a layer's two halves) and `run_layers` (the stream over the layers, block by block) are the
one definition of this wiring, with or without attention residuals, for the HF model and the vLLM plugin.
"""

from __future__ import annotations

import torch
from torch import nn

from model.chunking import over_tokens
from model.config import MarathonConfig


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


class ResidualWiring:
    """The residual wiring of a decoder layer, shared by the HF model and the vLLM plugin (mixed into their
    `nn.Module` layers): modules ``input_layernorm``, ``post_attention_layernorm``, ``attn_res`` / ``mlp_res``
    (`AttnResidualMix`, None without attention residuals; ``attn_res`` also None in layer 0, whose attention
    input is always the embedding alone) and methods ``mix(x, *args) -> out`` and
    ``ffn(x, *args) -> (out, aux)`` on normalised input.

    Plain residual: hidden is the stream and blocks is None. Attention residuals: hidden is the current partial
    block (None at a block start) and blocks the list of completed block outputs. Tokens are [..., T, D]; a
    sublayer's input (the mix and its norm) is computed in token chunks on long rows (`model.chunking`)."""

    def add_residual_mixes(self, config: MarathonConfig, layer_idx: int) -> None:
        """``attn_res`` / ``mlp_res`` of layer ``layer_idx``."""
        D, eps, on = config.hidden_size, config.rms_norm_eps, config.attn_residual
        self.attn_res = AttnResidualMix(D, eps) if on and layer_idx > 0 else None
        self.mlp_res = AttnResidualMix(D, eps) if on else None

    def mixer_half(self, hidden, blocks, *args):
        """hidden + mix(input); at a block start the mixer output starts the partial block."""
        out = self.mix(_normed_input(hidden, blocks, self.attn_res, self.input_layernorm), *args)
        return out if hidden is None else hidden + out

    def ffn_half(self, hidden, blocks, *args):
        """-> (hidden + ffn(input), the ffn's aux output)."""
        out, aux = self.ffn(_normed_input(hidden, blocks, self.mlp_res, self.post_attention_layernorm), *args)
        return hidden + out, aux


def _normed_input(hidden: torch.Tensor | None, blocks: list[torch.Tensor] | None, mix: AttnResidualMix | None,
                  norm: nn.Module) -> torch.Tensor:
    """norm(the stream (plain residual), or the mix over the completed blocks and the partial block) [..., T, D],
    ``TOKEN_CHUNK`` tokens at a time on long rows: the mix's and the norm's fp32 [T, D] temporaries (and, with
    gradients, what they save for the backward) are one chunk's."""
    if blocks is None:
        sources = [hidden]
    else:
        sources = blocks if hidden is None else [*blocks, hidden]
    if mix is None:
        return over_tokens(norm, sources[0], dim=-2)
    return over_tokens(lambda *chunk: norm(mix(list(chunk))), *sources, dim=-2)


def run_layers(layers, hidden: torch.Tensor, final_res: AttnResidualMix | None, block_size: int, step,
               norm: nn.Module) -> torch.Tensor:
    """The residual stream through ``layers``: ``step(i, layer, hidden, blocks) -> hidden`` runs layer i (blocks
    as in `ResidualWiring`). With attention residuals (``final_res`` given) every ``block_size`` layers close a
    block, and the output is ``norm`` of ``final_res`` over all blocks (else of the stream). hidden: the
    embeddings [..., T, D] -> [..., T, D]."""
    blocks = None if final_res is None else [hidden]
    stream = hidden if final_res is None else None
    for i, layer in enumerate(layers):
        stream = step(i, layer, stream, blocks)
        if blocks is not None and (i + 1) % block_size == 0 and i + 1 < len(layers):
            blocks, stream = [*blocks, stream], None  # block complete
    return _normed_input(stream, blocks, final_res, norm)
