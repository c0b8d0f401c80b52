"""Learner memory on CPU grows linearly with the episode length: no [T, T] mask or score matrix, packed
linear-attention rows laid out on chunk boundaries (not padded to the longest), long rows through the chunked
gated delta rule segment by segment, and one forward + backward of the tiny preset measured in fresh processes
(benchmarks/learner/cpu_memory.py)."""

from __future__ import annotations

import pytest
import torch

import kernels.chunked_gated_delta as cgd
from kernels.chunked_gated_delta import chunk_gated_delta_rule

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(T, H=2, K=16, V=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=dtype)
    gate = -5 * torch.sigmoid(torch.randn(1, T, H, K, generator=g, dtype=dtype))
    beta = torch.sigmoid(torch.randn(1, T, H, generator=g, dtype=dtype))
    return [x.requires_grad_() for x in (q, k, v, gate, beta)]


@pytest.mark.parametrize("cu", [None, [0, 1, 200, 263, 264, 700, 701]])
def test_long_rows_train_segment_by_segment(monkeypatch, cu):
    """A row longer than SEGMENT_TOKENS (segments of 128 here; sequences crossing the cuts) equals the whole-row
    computation: outputs, final states and every gradient, initial states included (fp64)."""
    T = 701
    cu_t = None if cu is None else torch.tensor(cu)
    n = 1 if cu is None else len(cu) - 1
    h0 = torch.randn(n, 2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()

    def run(seg):
        monkeypatch.setattr(cgd, "SEGMENT_TOKENS", seg)
        xs = _inputs(T)
        o, ht = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
        w = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((o * w).sum() + ht.square().sum(), [*xs, h0])
        return [o, ht, *grads]

    whole, segmented = run(1 << 20), run(128)
    for a, b in zip(segmented, whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_packed_rows_are_laid_out_on_chunk_boundaries(monkeypatch):
    """One long and many short sequences: each is padded to a multiple of the chunk, not to the longest."""
    seen = []
    real = cgd._chunked
    monkeypatch.setattr(cgd, "_chunked", lambda q, *a, **kw: seen.append(q.shape[1]) or real(q, *a, **kw))
    lengths = [1000] + [3] * 40
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    xs = _inputs(sum(lengths))
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs, output_final_state=True, cu_seqlens=cu)
    assert seen == [1024 + 40 * 64]  # not 41 x 1000
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        with torch.no_grad():
            o_i, h_i = chunk_gated_delta_rule(*(x[:, lo:hi] for x in xs), output_final_state=True)
        torch.testing.assert_close(o[:, lo:hi], o_i, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ht[i : i + 1], h_i, rtol=1e-10, atol=1e-10)


def _measure(length):
    """One step in a fresh process, glibc's mmap threshold fixed (freed tensors go back to the OS, so the
    resident set follows the live tensors; benchmarks/learner/cpu_memory.md has the default allocator too)."""
    from benchmarks.learner.cpu_memory import measure_in_subprocess

    return measure_in_subprocess(length, threads=1, malloc="mmap")


def test_peak_rss_grows_linearly_with_the_episode():
    """One forward + backward of the tiny preset (gradient checkpointing, token-chunked head) at 8K and 16K
    tokens, each in a fresh process: the peak resident set at 16K stays under 1.6x the 8K one, and the growth
    per token does not rise with length. (The dense [T, T] masks measured 1.75 GB at 8K and 13.7 GB at 32K.)"""
    small, large = _measure(8192), _measure(16384)
    assert large["peak_rss_mib"] < 1.6 * small["peak_rss_mib"], (small, large)
    assert large["growth_mib"] / 16384 < 1.25 * small["growth_mib"] / 8192, (small, large)
    assert large["peak_rss_mib"] < 1200, large


@pytest.mark.slow
def test_one_32k_token_episode_trains_under_2_gb():
    """Acceptance (issue 12): forward + backward of the tiny preset on one 32K-token episode, gradient
    checkpointing on, peaks under 2 GB of resident memory."""
    row = _measure(32768)
    assert row["peak_rss_mib"] < 2048, row
