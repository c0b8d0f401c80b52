"""`marathon bench ...`: measurements that back the figures in README.md and benchmarks/.

Each benchmark is a module ``marathon/commands/bench_<name>.py`` exposing ``register(subparsers)``; list it in
``BENCHES`` once it runs end to end."""

from __future__ import annotations

import importlib

BENCHES: tuple[str, ...] = ("memory", "rollout", "kernels", "parity", "learner")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (memory, parity, rollout, kernels, learner)")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(f"marathon.commands.bench_{name}").register(sub)
