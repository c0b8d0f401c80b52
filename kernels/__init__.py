"""Marathon's kernels. Each op has a plain PyTorch reference; the functions exported here pick the fastest
path available for the inputs (a Triton kernel on CUDA when present, else the PyTorch path)."""

from kernels.gated_delta import gated_delta_rule_step, recurrent_gated_delta_rule
from kernels.grouped_gemm import grouped_mm_reference

__all__ = ["gated_delta_rule_step", "recurrent_gated_delta_rule", "grouped_mm_reference"]
