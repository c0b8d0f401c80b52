"""``marathon env list`` / ``marathon env check ID``: discover and validate environments (``envs/``)."""

from __future__ import annotations

import argparse
import json

from envs.seeds import heldout_seeds


def _list(args: argparse.Namespace) -> int:
    from envs.registry import list_envs, load_plugins

    entries = list_envs()
    width = max(len(e.id) for e in entries)
    for e in entries:
        print(f"{e.id:<{width}}  {e.source}  [{e.entry_point}]")
    for name, error in load_plugins().items():
        print(f"broken plugin {name}: {error}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from envs.check import check_env

    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        print(f"--kwargs is not valid JSON: {e}")
        return 2
    if not isinstance(kwargs, dict):
        print("--kwargs must be a JSON object")
        return 2
    seeds = heldout_seeds(args.seeds)
    report = check_env(args.env_id, kwargs, seeds, max_steps=args.max_steps)
    if report.random_rate is not None:
        oracle = "n/a (no oracle_action)" if report.oracle_rate is None else f"{report.oracle_rate:.2f}"
        print(f"{args.env_id} {kwargs or ''}: oracle success {oracle}, random success {report.random_rate:.2f} "
              f"over {report.seeds} held-out seeds")
    for p in report.problems:
        print(f"FAIL: {p}")
    print("OK" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="list and check tool-calling environments")
    sub = parser.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)
    p_list = sub.add_parser("list", help="show built-in and plugin environment ids with their source")
    p_list.set_defaults(func=_list)
    p_check = sub.add_parser("check", help="validate an environment (API shape, determinism, episodes)")
    p_check.add_argument("env_id")
    p_check.add_argument("--seeds", type=int, default=10, help="episodes per policy (held-out seeds)")
    p_check.add_argument("--kwargs", default="{}", help='env options as JSON, e.g. \'{"difficulty": "hard"}\'')
    p_check.add_argument("--max-steps", type=int, default=200, help="step limit per episode")
    p_check.set_defaults(func=_check)
