"""kernels/chunk_replay.py: a sequence fed in pieces (prefills starting mid-chunk, one-token decodes) gives the
outputs of the whole-sequence chunked forward bit for bit; the recurrent step does not (bf16)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.chunk_replay import chunk_replay, chunk_replay_decode, tail_width

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is much faster on the shared cores

# the learner's call: the bounded gate's logits go into the kernel (model.attention.linear)
CHUNK_FN = functools.partial(kernels.gated_delta_rule, bounded_gate=True, gate_lower_bound=-5.0)


def inputs(T: int, dtype: torch.dtype, H=2, K=16, V=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, generator=gen).to(dtype)
    logits = 2 * torch.randn(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, logits, beta


def replay(xs, pieces: list[int]):
    """Feeds xs through chunk_replay in pieces; returns (o [1, T, H, V], boundary state, tail)."""
    q = xs[0]
    state, tail, outs, pos = None, q.new_zeros(0, q.shape[2], tail_width(q.shape[-1], xs[2].shape[-1]), dtype=torch.float32), [], 0
    for n in pieces:
        o, state, tail = chunk_replay(CHUNK_FN, *(x[:, pos:pos + n] for x in xs), state, tail)
        assert o.shape[1] == n
        outs.append(o)
        pos += n
    return torch.cat(outs, dim=1), state, tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_equal_whole_sequence_forward(dtype):
    # a 70-token prompt, decodes across a chunk boundary, a 45-token tool output starting mid-chunk, more decodes
    pieces = [70] + [1] * 60 + [45] + [1] * 17
    T = sum(pieces)
    xs = inputs(T, dtype)
    ref, _ = CHUNK_FN(*xs, output_final_state=True)
    out, state, tail = replay(xs, pieces)
    assert torch.equal(out, ref)
    assert tail.shape[0] == T % 64
    # the carried state is the whole-sequence forward's state at the last boundary
    _, ref_state = CHUNK_FN(*(x[:, : T - T % 64] for x in xs), output_final_state=True)
    assert torch.equal(state, ref_state)


def test_recurrent_decode_drifts_in_bf16():
    """What the replay removes: decoding the same tokens with the fp32 recurrent step differs from the chunked
    forward in bf16 (the tile products round their operands)."""
    xs = inputs(192, torch.bfloat16)
    ref, _ = CHUNK_FN(*xs)
    q, k, v, logits, beta = xs
    g = -5.0 * torch.sigmoid(logits)
    state = torch.zeros(1, q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        o, state = kernels.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o.to(v.dtype))
    assert (torch.stack(outs, 1).float() - ref.float()).abs().max() > 1e-3


def test_full_tail_is_refused():
    xs = inputs(1, torch.float32)
    with pytest.raises(ValueError, match="since the last chunk boundary"):
        chunk_replay(CHUNK_FN, *xs, None, torch.zeros(64, 2, tail_width(16, 32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_whole_sequence_forward(dtype):
    """Three sequences decoding together, at different offsets in their chunks (one completes a chunk)."""
    prefills = [63, 10, 100]
    seqs = [inputs(n + 3, dtype, seed=i) for i, n in enumerate(prefills)]
    carried = [replay(tuple(x[:, :n] for x in xs), [n]) for xs, n in zip(seqs, prefills)]
    states = torch.cat([c[1] if c[1] is not None else torch.zeros(1, 2, 16, 32) for c in carried])
    tails = [c[2] for c in carried]
    for step in range(3):
        tok = [tuple(x[0, n + step] for x in xs) for xs, n in zip(seqs, prefills)]
        o, states, tails = chunk_replay_decode(CHUNK_FN, *(torch.stack(t) for t in zip(*tok)), states, tails)
        for b, (xs, n) in enumerate(zip(seqs, prefills)):
            ref, _ = CHUNK_FN(*(x[:, : n + step + 1] for x in xs))
            assert torch.equal(o[b], ref[0, -1]), (b, step)
