"""Triton kernels for the gated delta rule (KDA-style linear attention) on the GPU.

Chunked form (chunk ``BT = 64``, sub-tiles of ``BC = 16`` tokens), per head, inside chunk ``n`` with
start state ``S`` [K, V] and chunk-local cumulative log-decay ``G_t = sum_{s<=t} g_s`` (per key channel):

    Akk[i, j] = beta_i * sum_c k_i k_j exp(G_i - G_j)       j <  i   (strictly lower)
    Aqk[t, i] = scale  * sum_c q_t k_i exp(G_t - G_i)       i <= t
    T  = (I + Akk)^-1
    w  = T diag(beta) (k * exp(G))        u = T diag(beta) v          (WY form)
    U  = u - w S                                                       ("new values")
    o  = scale * (q * exp(G)) S + Aqk U
    S' = diag(exp(G_L)) S + (k * exp(G_L - G))^T U                     (G_L: last row of the chunk)

The per-channel factors ``exp(G_t - G_i)`` are split through a reference row ``r`` so every pair term is a
tensor-core matmul: ``(q_t exp(G_t - G_r)) . (k_i exp(G_r - G_i))``. With the bounded gate
``g >= -5`` the factors stay inside fp32's exponent range within a 16-token sub-tile (``<= exp(80)``),
which is why the wrapper refuses decays below ``G_MIN_SAFE``.

Forward kernels: gate + cumsum -> pair matrices -> blocked triangular inverse + WY (also writes
kd = k exp(G_L - G) and qg = scale q exp(G)) -> sequential state pass -> output. Backward: Aqk^T dO ->
sequential reverse state pass -> value-side grads -> state-side grads -> dAkk -> pair-matrix grads (one
program per 16-row sub-tile) -> dg, the chunk's reverse cumsum of dG. Only the state is carried through the
two sequential kernels; everything else is prepared by parallel kernels. Intermediates are kept from the
forward (no recompute). The pair products take fp32 operands (tf32 for 16-bit inputs): the gate gradient is
a difference of nearly equal terms and bf16 operands there cost a 10x larger error
(benchmarks/kernels/NOTES.md); the two backward pair products whose errors cancel in it run in 3xTF32 always
(chunk_bwd._bwd_pair_kernel). Plain pointer arithmetic throughout, so the kernels also run under Triton's
CPU interpreter (tests/test_kernels_triton_interpret.py).

Shapes (as in ``kernels/gated_delta.py``): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V] fp32. K and V must be 64, 128 or 256.

Files, as flash-linear-attention lays out a kernel family: ``common.py`` (constants, tile helpers),
``chunk_fwd.py`` / ``chunk_bwd.py`` (the kernels), ``chunk.py`` (launches, autograd, packed rows),
``fused_recurrent.py`` (the one-token decode step). The plain PyTorch references are ``kernels/gated_delta.py``
(recurrence, step) and ``kernels/chunked_gated_delta.py`` (the same chunked algorithm).
"""

from kernels.gated_delta_triton.chunk import chunk_gated_delta_rule_triton
from kernels.gated_delta_triton.chunk_bwd import (PAIR_CONFIGS, SIDE_CONFIGS, _bwd_pair_kernel, _bwd_state_side_kernel,
                                                  _state_bwd_kernel)
from kernels.gated_delta_triton.chunk_fwd import STATE_CONFIGS, _state_fwd_kernel
from kernels.gated_delta_triton.common import CHUNK, G_MIN_SAFE, float32_matmul_precision
from kernels.gated_delta_triton.fused_recurrent import gated_delta_rule_step_triton

__all__ = ["CHUNK", "G_MIN_SAFE", "PAIR_CONFIGS", "SIDE_CONFIGS", "STATE_CONFIGS",
           "chunk_gated_delta_rule_triton", "float32_matmul_precision", "gated_delta_rule_step_triton"]
