"""Two ways to invert the solve's 16x16 unit lower-triangular diagonal blocks in fp32, against fp64: an fp64 study on
the CPU.

The solve (kernels/gated_delta_triton/chunk_fwd.py) inverts each 16x16 diagonal block I + L of I + Akk (L strictly
lower) before it merges the blocks below. Two forms, both in fp32 as the kernel computes them:
- forward substitution, row by row (14 dependent steps, each a row of L and a reduction across the rows before it);
- the product (I + N)(I + N^2)(I + N^4)(I + N^8), N = -L: the sum of N^0..N^15, exact since N^16 = 0 (three
  squarings and three products, each a 16x16 matmul).
Akk comes from q, k, gate logits and beta as the kernel bench draws them (unit keys, gate logits ~ N(mean, 1));
``--key-norm`` scales the keys (KDA normalises them; larger keys make Akk's blocks larger and worse conditioned).
Prints, per gate mean, each form's largest norm-relative error against fp64 over every block:

    python benchmarks/kernels/diag_inverse.py
    python benchmarks/kernels/diag_inverse.py --key-norm 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kernels.tinv_rounding import C, akk, chunk_inputs, decays  # noqa: E402

F64 = torch.float64
B = 16  # the diagonal blocks' size


def diagonal_blocks(inputs: list[torch.Tensor], key_norm: float) -> torch.Tensor:
    """The strictly lower 16x16 diagonal blocks of Akk = beta_i sum_c k_i k_j exp(G_i - G_j), i > j. [N, 16, 16]"""
    q, k, v, raw, beta, S0 = inputs
    A = akk(k * key_norm, beta, decays(raw)[1])  # [rows, heads, C, C]
    return torch.stack([A[..., b:b + B, b:b + B] for b in range(0, C, B)], -3).reshape(-1, B, B)


def substitution(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 row by row in L's dtype: row i of the strictly lower part is -L[i, :i] - L[i, :] X."""
    X = -L.tril(-1)  # rows 0 and 1 are final
    for i in range(2, B):
        row = -L[..., i, :] * (torch.arange(B) < i)
        X[..., i, :] = row + (row[..., :, None] * X).sum(-2)
    return X + torch.eye(B, dtype=L.dtype)


def product(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 = (I + N)(I + N^2)(I + N^4)(I + N^8), N = -L, in L's dtype."""
    N = -L
    X = torch.eye(B, dtype=L.dtype) + N
    for _ in range(3):
        N = N @ N
        X = X + X @ N
    return X


def errors(L: torch.Tensor) -> dict[str, float]:
    """Each form's largest norm-relative error against the fp64 inverse, computed in fp32; and the inverse's
    largest entry."""
    exact = torch.linalg.inv(torch.eye(B, dtype=F64) + L)
    rel = lambda X: ((X.to(F64) - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).max().item()  # noqa: E731
    return {"substitution": rel(substitution(L.float())), "product": rel(product(L.float())),
            "largest_entry": exact.abs().max().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gate-means", default="3,0,-10", help="gate logit means (comma-separated)")
    p.add_argument("--key-norm", type=float, default=1.0, help="the keys' norm (1: KDA's normalised keys)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    a = p.parse_args()
    print(f"{a.rows} rows x {a.heads} heads x 4 blocks per gate mean, head dim 64, keys of norm {a.key_norm}")
    print("| gate mean | substitution | product | largest entry of the inverse |\n|---:|---:|---:|---:|")
    for mean in map(float, a.gate_means.split(",")):
        e = errors(diagonal_blocks(chunk_inputs(a.rows, a.heads, 64, mean, 1.0), a.key_norm))
        print(f"| {mean:g} | {e['substitution']:.2e} | {e['product']:.2e} | {e['largest_entry']:.1f} |")


if __name__ == "__main__":
    main()
