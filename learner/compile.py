"""The model's token-local glue fused by ``torch.compile`` (the one seam; the model is unchanged).

The H200 profile of a 64K-token update (benchmarks/learner/h200/README.md) spends about two thirds of the device
time in PyTorch's elementwise, reduction and copy kernels, one small kernel per op, in fp32, and each run again by
the checkpointed recompute: RMSNorms, the attention-residual mixes, the short convs' taps, q/k norms, gates,
RoPE, SwiGLU's gate. The matmuls and the attention / KDA kernels are a third. ``compile_token_local`` hands every
such function to ``torch.compile`` (Inductor fuses each into a few kernels, forward and backward), as
torchtitan's ``apply_compile`` compiles its blocks (https://github.com/pytorch/torchtitan): the forward of the
token-local modules and the token-local methods of the attention layers, the MoE router and the experts. Only plain
tensor math is compiled, so there is no graph break and no recompile per packing: the layers' Python around it
(packed-row bounds, token chunks, segments, the Triton kernels, attention, expert dispatch) stays eager.

``dynamic=True``: one graph serves every row length (one per grad mode; the attention-residual mix one per
number of sources). A module's hooks (DeepSpeed's) stay outside the compiled function: the instance's ``forward``
is replaced, not its ``__call__``.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from model.attention.conv import ShortConv
from model.attention.linear import LinearAttention
from model.attention.mla import GatedMLA
from model.attention.sliding import SlidingWindowAttention
from model.attn_residual import AttnResidualMix
from model.moe import Experts, Router, SwiGLU
from model.norm import RMSNorm
from model.rope import RotaryEmbedding

TOKEN_LOCAL = (RMSNorm, AttnResidualMix, ShortConv, SwiGLU, RotaryEmbedding)  # RMSNorm: GatedRMSNorm too
# The token-local methods of the attention layers (projections, short convs, q/k norms, gates, RoPE, the output
# gate and norm) and of the MoE router. Their kernels, packed-row bounds and token chunks stay eager around them.
TOKEN_LOCAL_METHODS = {
    LinearAttention: ("_kernel_inputs", "output"),
    SlidingWindowAttention: ("_qkv",),
    GatedMLA: ("_gated_output",),
    Router: ("scores", "route"),  # fp32 scores, clip, sigmoid, balancing, top-k, renormalised weights
    Experts: ("activation",),  # SwiGLU's product on the sorted rows
}
# Token-local submodules called only inside those methods: left as they are, so the method's graph traces them.
# Compiled on their own as well, they broke that graph under torch 2.11 (the GPU machine's): its Dynamo, inlining
# a module whose forward is a compiled bound method, called the function without ``self`` ("failed to bind
# arguments"), and the rest of the method - short convs, fp32 q/k norms, the output norm - ran eagerly, 10 ms of a
# KDA layer's 53 ms at 64K on the H100 (benchmarks/learner/h100/README.md). torch 2.13 inlines them correctly.
INSIDE_METHODS = {
    LinearAttention: ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm"),
    SlidingWindowAttention: ("rotary",),
}


def compile_token_local(model: nn.Module) -> int:
    """Compile, in place, the forward of every token-local module of ``model`` and the token-local methods of its
    attention layers and routers -> how many methods were replaced.

    Each instance gets the class's compiled function bound to itself (one compiled function per class and method,
    shared by all instances): a ``copy.deepcopy`` of the model (the KL reference) binds it to the copy, where a
    compiled bound method would keep calling the original module's weights."""
    inside = {id(getattr(owner, name)) for owner in model.modules() for cls, names in INSIDE_METHODS.items()
              if isinstance(owner, cls) for name in names if getattr(owner, name, None) is not None}
    replaced = 0
    for module in model.modules():
        names = ["forward"] if isinstance(module, TOKEN_LOCAL) and id(module) not in inside else []
        names += [m for cls, methods in TOKEN_LOCAL_METHODS.items() if isinstance(module, cls) for m in methods]
        for name in names:
            setattr(module, name, types.MethodType(compile_fn(getattr(type(module), name)), module))
        replaced += len(names)
    return replaced


@functools.cache
def compile_fn(fn):
    """``torch.compile(fn, dynamic=True)``, once per function (the class's method, the logprob head's block)."""
    return torch.compile(fn, dynamic=True)
