"""The MoE's gather-sum (kernels/gather_sum.py): the Triton kernel, run on the CPU through Triton's interpreter,
against the PyTorch form in fp64; values and both gradients, with and without weights, ragged tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import gather_sum_reference

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import json, sys
import torch, triton
import kernels.gather_sum_triton as gst
from kernels.gather_sum import gather_sum_reference
from kernels.gather_sum_triton import gather_sum_triton

N, k, D, weighted, BN = json.loads(sys.argv[1])
for kern in (gst._gather_sum_fwd_kernel, gst._gather_sum_bwd_kernel):  # the interpreter cannot time configs
    kern.configs = [triton.Config({"BN": BN}, num_warps=4)]
torch.manual_seed(N * 7 + k)
y = torch.randn(N * k, D)
index = torch.randperm(N * k)
w = torch.rand(N, k) if weighted else None
dout = torch.randn(N, D, dtype=torch.float64)

def run(fn, dtype):
    ys = y.to(dtype).requires_grad_()
    ws = None if w is None else w.to(dtype).requires_grad_()
    out = fn(ys, index, k, ws)
    grads = torch.autograd.grad((out.double() * dout).sum(), [t for t in (ys, ws) if t is not None])
    return [out.detach(), *grads]

ref, got = run(gather_sum_reference, torch.float64), run(gather_sum_triton, torch.float32)
print(json.dumps([((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, ref)]))
"""


@pytest.mark.parametrize("N, k, D, weighted, BN", [
    (37, 4, 600, True, 16),   # ragged token tile and hidden tile (BD 512)
    (16, 3, 512, False, 8),   # k not a power of two; the dispatch's backward (no weights)
    (5, 1, 1030, True, 32),   # one slot per token, three hidden tiles
])
def test_triton_gather_sum_matches_reference_in_interpreter(N, k, D, weighted, BN):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps([N, k, D, weighted, BN])], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errs) == (3 if weighted else 2)
    assert max(errs) < 1e-6, errs  # fp32 sums of k terms


def test_reference_is_the_per_token_weighted_sum():
    torch.manual_seed(0)
    N, k, D = 6, 3, 5
    y, index, w = torch.randn(N * k, D, dtype=torch.float64), torch.randperm(N * k), torch.rand(N, k, dtype=torch.float64)
    want = torch.stack([sum(w[n, j] * y[index[n * k + j]] for j in range(k)) for n in range(N)])
    torch.testing.assert_close(gather_sum_reference(y, index, k, w), want)
    torch.testing.assert_close(gather_sum_reference(y, index, k), torch.stack(
        [sum(y[index[n * k + j]] for j in range(k)) for n in range(N)]))
