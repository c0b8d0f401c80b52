"""Seed splits: training and held-out evaluation seeds come from disjoint ranges.

Every built-in environment derives its whole task from the ``reset`` seed, so a seed names one task.
Training seeds are ``[0, HELDOUT_START)``; held-out seeds are ``[HELDOUT_START, HELDOUT_START + SPLIT_SIZE)``.
"""

from __future__ import annotations

HELDOUT_START = 1_000_000_000
SPLIT_SIZE = 1_000_000_000


def _check(n: int, start: int) -> None:
    if not 0 <= n <= SPLIT_SIZE or not 0 <= start <= SPLIT_SIZE - n:
        raise ValueError(f"need 0 <= start and start + n <= {SPLIT_SIZE}, got start={start}, n={n}")


def train_seeds(n: int, start: int = 0) -> list[int]:
    """``n`` training seeds, from ``start`` within the training range."""
    _check(n, start)
    return list(range(start, start + n))


def heldout_seeds(n: int, start: int = 0) -> list[int]:
    """``n`` held-out evaluation seeds (never produced by ``train_seeds``)."""
    _check(n, start)
    return list(range(HELDOUT_START + start, HELDOUT_START + start + n))


def is_heldout(seed: int) -> bool:
    return HELDOUT_START <= seed < HELDOUT_START + SPLIT_SIZE
