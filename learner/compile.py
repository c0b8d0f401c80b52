"""The model's token-local glue fused by ``torch.compile`` (the one seam; the model is unchanged).

The H200 profile of a 64K-token update (benchmarks/learner/h200/README.md) spends about two thirds of the device
time in PyTorch's elementwise, reduction and copy kernels, one small kernel per op, in fp32, and each run again by
the checkpointed recompute: RMSNorms, the attention-residual mixes, the short convs' taps, SwiGLU's gate. The
matmuls and the attention / KDA kernels are a third. ``compile_token_local`` hands the forward of every such
module to ``torch.compile`` (Inductor fuses each into a few kernels, forward and backward), as torchtitan's
``apply_compile`` compiles its blocks (https://github.com/pytorch/torchtitan). Only modules whose forward is
plain tensor math are compiled, so there is no graph break and no recompile per packing: the layers' Python
(packed-row bounds, token chunks, Triton kernels, MoE dispatch) stays eager.

``dynamic=True``: one graph serves every row length. The attention-residual mix compiles once per number of
sources (blocks so far + 1). The module's hooks (DeepSpeed's) stay outside the compiled function: the instance's
``forward`` is replaced, not its ``__call__``.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention.conv import ShortConv
from model.attn_residual import AttnResidualMix
from model.moe import SwiGLU
from model.norm import RMSNorm

TOKEN_LOCAL = (RMSNorm, AttnResidualMix, ShortConv, SwiGLU)  # RMSNorm includes GatedRMSNorm


def compile_token_local(model: nn.Module) -> int:
    """Compile the forward of every token-local module of ``model`` in place -> how many were compiled."""
    compiled = 0
    for module in model.modules():
        if isinstance(module, TOKEN_LOCAL):
            module.forward = torch.compile(module.forward, dynamic=True)
            compiled += 1
    return compiled
