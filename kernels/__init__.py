"""Marathon's kernels. Each op has a plain PyTorch reference; the functions exported here pick the fastest
path available for the inputs (a Triton kernel on CUDA when present, else the PyTorch path)."""

from __future__ import annotations

import torch

from kernels.chunk_replay import chunk_replay
from kernels.chunked_gated_delta import chunk_gated_delta_rule
from kernels.gated_delta import gated_delta_rule_step as gated_delta_rule_step_reference
from kernels.gated_delta import recurrent_gated_delta_rule
from kernels.gated_delta_segmented import segmented_gated_delta_rule
from kernels.gather_sum import gather_sum_reference
from kernels.grouped_gemm import grouped_mm_reference, grouped_mm_torch

try:  # triton is absent on CPU-only installs
    from kernels.gated_delta_triton import CHUNK as TRITON_CHUNK
    from kernels.gated_delta_triton import chunk_gated_delta_rule_triton, gated_delta_rule_step_triton
    from kernels.gather_sum_triton import gather_sum_triton as _gather_sum_triton  # the module keeps its name
    from kernels.grouped_gemm_triton import grouped_mm_triton
except ImportError:
    chunk_gated_delta_rule_triton = gated_delta_rule_step_triton = _gather_sum_triton = grouped_mm_triton = None


# Rows longer than this run through the Triton kernel one segment at a time (kernels/gated_delta_segmented.py):
# the kernel's saved intermediates for 16 heads of 128 are ~27 GiB per 256K tokens.
SEGMENT_TOKENS = 1 << 18


def _triton_handles(q: torch.Tensor, v: torch.Tensor, chunk_size: int, bounded_gate: bool) -> bool:
    """The Triton kernel: CUDA tensors, the bounded gate (g >= -5), one chunk length, head dims 64, 128 or
    256; any length, packed rows included."""
    if chunk_gated_delta_rule_triton is None or not q.is_cuda or chunk_size != TRITON_CHUNK:
        return False
    return bounded_gate and all(d in (64, 128, 256) for d in (q.shape[-1], v.shape[-1]))


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    bounded_gate: bool = True,
    gate_lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a sequence (signature of ``chunk_gated_delta_rule``): the Triton kernel for
    CUDA tensors when it imports and handles the shapes, else the chunked PyTorch form. ``bounded_gate``
    says g came from the bounded gate (g >= -5). An unbounded (-softplus) gate takes the PyTorch path with
    exact diagonal tiles: its in-tile reciprocal decay overflows the factorised tile products (the Triton
    kernel refuses g below -5.5 for the same reason).

    With ``gate_lower_bound`` set, ``g`` holds the gate logits and the log-decay is
    ``gate_lower_bound * sigmoid(g)``: the Triton kernel computes it inside its chunk cumsum (no [T, H, K]
    fp32 decay tensor in memory), the PyTorch path computes it first."""
    if gate_lower_bound is not None and not bounded_gate:
        raise ValueError("gate_lower_bound is the bounded gate: bounded_gate must be True")
    if _triton_handles(q, v, chunk_size, bounded_gate):
        kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  gate_lower_bound=gate_lower_bound, cu_seqlens=cu_seqlens)
        if q.shape[0] == 1 and q.shape[1] > SEGMENT_TOKENS:
            return segmented_gated_delta_rule(chunk_gated_delta_rule_triton, q, k, v, g, beta,
                                              seg_tokens=SEGMENT_TOKENS, **kw)
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, **kw)
    if gate_lower_bound is not None:
        g = gate_lower_bound * torch.sigmoid(g.float())
    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
        exact_diagonal=not bounded_gate,
    )


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (contract of ``kernels.gated_delta.gated_delta_rule_step``): the fused Triton step on
    CUDA for an fp32 state and power-of-two head dims (5.3x the PyTorch step on the H200, benchmarks/kernels),
    else the PyTorch step."""
    K, V = q.shape[-1], v.shape[-1]
    if (gated_delta_rule_step_triton is not None and q.is_cuda and state.dtype == torch.float32
            and all(d >= 16 and d & (d - 1) == 0 for d in (K, V))):
        return gated_delta_rule_step_triton(q, k, v, g, beta, state.contiguous(), scale)
    return gated_delta_rule_step_reference(q, k, v, g, beta, state, scale)


# The MoE grouped GEMM on CUDA: "torch" (``torch._grouped_mm``, PyTorch's CUTLASS grouped GEMM on Hopper, faster
# than ours in the model's MoE on the H200: benchmarks/learner/h200/README.md) or "triton" (ours).
GROUPED_MM_CUDA = "torch"


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """MoE grouped matmul (x [N, D] sorted by expert, w [E, D, F], offsets [E + 1] -> [N, F]): on CUDA with
    matching dtypes, one grouped GEMM launch for all experts (``GROUPED_MM_CUDA`` picks whose; torch's takes bf16
    on Hopper and later), else the per-expert reference."""
    if x.is_cuda and x.dtype == w.dtype:
        if GROUPED_MM_CUDA == "torch" and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and \
                torch.cuda.get_device_capability(x.device) >= (9, 0):
            return grouped_mm_torch(x, w, offsets)
        if grouped_mm_triton is not None:
            return grouped_mm_triton(x, w, offsets)
    return grouped_mm_reference(x, w, offsets)


# The MoE's gather-sums on CUDA: "triton" (ours, one pass) or "torch" (the PyTorch form; kept for the A/B in
# benchmarks/model/moe_layer.py).
GATHER_SUM_CUDA = "triton"


def gather_sum(y: torch.Tensor, index: torch.Tensor, k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE's combine and its dispatch's backward (y [N*k, D], index [N*k] a permutation, weights [N, k] or None
    -> [N, D], kernels/gather_sum.py): the one-pass Triton kernel on CUDA, else the PyTorch form."""
    if GATHER_SUM_CUDA == "triton" and _gather_sum_triton is not None and y.is_cuda:
        return _gather_sum_triton(y, index, k, weights)
    return gather_sum_reference(y, index, k, weights)


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_replay",
    "gather_sum",
    "gather_sum_reference",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_mm_torch",
    "recurrent_gated_delta_rule",
]
