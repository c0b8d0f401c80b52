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
    if args.config:  # the env of a run config (its env.id and env.kwargs; --kwargs entries override)
        from configs.schema import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            print(f"error: {e}")
            return 2
        if args.env_id not in (None, cfg.env.id):
            print(f"error: {args.config} trains {cfg.env.id}, not {args.env_id}")
            return 2
        args.env_id, kwargs = cfg.env.id, {**cfg.env.kwargs, **kwargs}
        if args.context_tokens is None:  # the first stage's episode budget
            args.context_tokens = cfg.resolved_stages()[0].max_episode_tokens
    if args.env_id is None:
        print("error: give an env id or --config RUN.yaml")
        return 2
    seeds = heldout_seeds(args.seeds)
    report = check_env(args.env_id, kwargs, seeds, max_steps=args.max_steps, timeout_s=args.timeout_s,
                       context_tokens=args.context_tokens or 4096, threads=args.threads)
    shown = f"{args.env_id} ({args.config})" if args.config else f"{args.env_id} {kwargs or ''}"
    if report.random_rate is not None:
        oracle = "n/a (no oracle_action)" if report.oracle_rate is None else f"{report.oracle_rate:.2f}"
        print(f"{shown}: oracle success {oracle}, random success {report.random_rate:.2f} "
              f"over {report.seeds} held-out seeds")
    for note in report.notes:
        print(f"  {note}")
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
    p_check.add_argument("env_id", nargs="?", help="env id (optional with --config)")
    p_check.add_argument("--config", help="check the env of a run config (env.id and env.kwargs), e.g. "
                                          "examples/own_tasks/config.yaml")
    p_check.add_argument("--seeds", type=int, default=10, help="episodes per policy (held-out seeds)")
    p_check.add_argument("--kwargs", default="{}", help='env options as JSON, e.g. \'{"difficulty": "hard"}\'')
    p_check.add_argument("--max-steps", type=int, default=200, help="step limit per episode")
    p_check.add_argument("--timeout-s", type=float, default=30.0, help="time limit of one reset/step (a hang)")
    p_check.add_argument("--context-tokens", type=int, default=None,
                         help="episode token budget the prompt and observations must fit (default: the config's "
                              "max_episode_tokens with --config, else 4096)")
    p_check.add_argument("--threads", type=int, default=4, help="instances stepped concurrently from threads")
    p_check.set_defaults(func=_check)
