"""Constants and tile helpers shared by the chunked gated-delta kernels (forward, backward, decode)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

CHUNK = 64  # chunk length
BT = tl.constexpr(CHUNK)  # the same, as the kernels see it
BC = tl.constexpr(16)  # sub-tile length: one reference row per 16 tokens keeps exp() finite
G_MIN_SAFE = -5.5  # 15 steps * 5.5 = 82.5 < log(fp32 max) ~ 88.7
# The sequential state kernels take at least this many steps per sequence: a loop of fewer iterations than its
# software pipeline's stages (num_stages, at most 3) faulted on the H200 in bf16 (illegal memory access in the
# state forward at T = 1, 63, 64; Triton 3.6). A shorter sequence repeats its last chunk with the results masked.
MIN_STEPS = tl.constexpr(3)


@triton.jit
def _tile(X, row0, n_rows, stride, col0, R: tl.constexpr, C: tl.constexpr):
    """Pointers (or offsets, for an integer X) [R, C] to rows row0.. and columns col0.. of a row-major view
    with row stride ``stride``, and the [R, 1] mask of the rows below ``n_rows``."""
    o_r = row0 + tl.arange(0, R)
    return X + o_r[:, None] * stride + col0 + tl.arange(0, C)[None, :], (o_r < n_rows)[:, None]


@triton.jit
def _chunk_rows(i_t, T, chunk_rows, VARLEN: tl.constexpr):
    """Rows [t0, t1) of chunk i_t: of a row of T tokens, or (VARLEN) of a packed row, from its chunk table
    chunk_rows [NT, 2] int32 (a sequence's chunks start at its first token; its last one ends at its end)."""
    if VARLEN:
        t0 = tl.load(chunk_rows + 2 * i_t)
        t1 = tl.load(chunk_rows + 2 * i_t + 1)
    else:
        t0 = i_t * BT
        t1 = tl.minimum(t0 + BT, T)
    return t0, t1


@triton.jit
def _sequence(T, NT, seqs, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
              VARLEN: tl.constexpr):
    """What this program of a sequential state kernel walks. Programs lie on one flat axis, V-slices innermost
    (sequences x heads can exceed a grid's y limit of 65,535): sequence p, head h, V-slice v. Sequence p is row p
    of T tokens, or (VARLEN) row p of the packed row's sequence table seqs [N, 4] int32 (sequence, first token,
    end token, first chunk), longest sequence first. Returns (V-slice, head, row, offset of the sequence's and
    head's [K, V] initial / final state, first token, end token, first chunk, number of chunks)."""
    NV: tl.constexpr = V // BV
    i_ph, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_p, i_h = i_ph // H, i_ph % H
    if VARLEN:
        i_n = tl.load(seqs + 4 * i_p)
        i_b = 0
        bos = tl.load(seqs + 4 * i_p + 1)
        eos = tl.load(seqs + 4 * i_p + 2)
        c0 = tl.load(seqs + 4 * i_p + 3)
        nc = tl.cdiv(eos - bos, BT)
    else:
        i_n = i_p
        i_b = i_p
        bos = 0
        eos = T
        c0 = 0
        nc = NT
    return i_v, i_h, i_b, (i_n * H + i_h).to(tl.int64) * K * V, bos, eos, c0, nc


@triton.jit
def _state_step(i_s, bos, eos, nc, REVERSE: tl.constexpr):
    """Step i_s of a sequential kernel over a sequence's nc chunks (last to first when REVERSE): (live, the
    chunk's index in the sequence, its first and end token). A sequence takes at least MIN_STEPS steps: the steps
    past its end repeat its last chunk (first, when REVERSE) with live false, and store and carry nothing."""
    live = tl.full([1, 1], i_s, tl.int32) < nc
    j = tl.minimum(i_s, nc - 1)
    if REVERSE:
        j = nc - 1 - j
    t0 = bos + j * BT
    return live, j, t0, tl.minimum(t0 + BT, eos)


@triton.jit
def _load16(A, r0, c0, n, RS: tl.constexpr):
    o = tl.arange(0, 16)
    return tl.load(A + (r0 + o)[:, None] * RS + c0 + o[None, :], mask=((r0 + o) < n)[:, None], other=0.0)


@triton.jit
def _store16(X, b_x, r0, c0, n, RS: tl.constexpr):
    o = tl.arange(0, 16)
    tl.store(X + (r0 + o)[:, None] * RS + c0 + o[None, :], b_x.to(X.dtype.element_ty), mask=((r0 + o) < n)[:, None])


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")  # exact fp32 (the inverse's small blocks)


@triton.jit
def _substitution_row(A, X, i, r0, n, RS: tl.constexpr):
    """Row i of (I + A_bb)^-1's strictly lower part for the 16x16 diagonal block at rows/cols r0..r0+15,
    given the rows before it in X: -A[i, :i] - A[i, :] X."""
    o = tl.arange(0, 16)
    b_a = -tl.load(A + (r0 + i) * RS + r0 + o, mask=(o < i) & (o * 0 + r0 + i < n), other=0.0)
    b_a += tl.sum(b_a[:, None] * X, 0)
    return tl.where((o == i)[:, None], b_a[None, :], X)


@triton.jit
def _diagonal_inverses16(A, n, RS: tl.constexpr):
    """(I + A_bb)^-1 of the four 16x16 diagonal blocks of a strictly lower [BT, BT] tile at ``A`` (row stride
    RS, ``n`` valid rows) by forward substitution, the four blocks in one loop so their rows overlap. 4 x [16, 16]."""
    o = tl.arange(0, 16)
    m_low = o[:, None] > o[None, :]
    b_X0 = -tl.where(m_low, _load16(A, 0, 0, n, RS), 0.0)  # rows 0 and 1 of each block are final
    b_X1 = -tl.where(m_low, _load16(A, 16, 16, n, RS), 0.0)
    b_X2 = -tl.where(m_low, _load16(A, 32, 32, n, RS), 0.0)
    b_X3 = -tl.where(m_low, _load16(A, 48, 48, n, RS), 0.0)
    for i in range(2, 16):
        b_X0 = _substitution_row(A, b_X0, i, 0, n, RS)
        b_X1 = _substitution_row(A, b_X1, i, 16, n, RS)
        b_X2 = _substitution_row(A, b_X2, i, 32, n, RS)
        b_X3 = _substitution_row(A, b_X3, i, 48, n, RS)
    b_I = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    return b_X0 + b_I, b_X1 + b_I, b_X2 + b_I, b_X3 + b_I


def _prec(q: torch.Tensor) -> str:
    """The dots' precision for inputs like ``q``. fp32 inputs follow ``torch.get_float32_matmul_precision()``, as
    torch's own fp32 matmuls do: "highest" (the default) gives fp32-accurate dots on the tensor cores, 3xTF32 (each
    operand split into a tf32 head and tail, three tf32 products), within the 1e-4 reference tolerance; "high" or
    "medium" give one tf32 product per dot (what fla's kernels use for fp32 inputs), about 3x less tensor-core
    work at 10-bit mantissa products. The plain fp32 ("ieee") dots ran on the CUDA cores, 8x slower than 3xTF32 at
    K = V = 64 and 18x slower than fla at K = V = 256 on the H200 (at 256 the state kernels need their
    unpipelined configs in 3xTF32: STATE_CONFIGS). For 16-bit inputs, dots of 16-bit operands run as bf16/fp16 on
    the tensor cores and dots of fp32 operands (the pair products) as tf32."""
    if q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(precision)`` inside the block (which _prec then reads), the earlier
    setting restored after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
