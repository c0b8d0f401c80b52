"""``marathon train CONFIG``: validate, then run SFT warm start + RL stages (``marathon/driver.py``)."""

from __future__ import annotations

import argparse
import json
import sys

import yaml


def parse_overrides(items: list[str]) -> dict:
    """``key.sub=value`` pairs; values are parsed as YAML (``rollout.group_size=4``, ``sft.steps=0``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --set expects key=value, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError
    from marathon.driver import GateFailed, RunAborted, Trainer, prepare

    if args.dry_run:  # the plan per stage, checked; no Ray started (marathon/plan.py)
        from marathon.plan import Cluster, dry_run

        cluster = None
        if args.gpus is not None or args.cpus is not None:
            cluster = Cluster(float(args.gpus or 0), float(args.cpus if args.cpus is not None else 1e9),
                              "the cluster given by --gpus/--cpus")
        return dry_run(args.config, parse_overrides(args.set), cluster)
    try:
        plan = prepare(args.config, parse_overrides(args.set))
        summary = Trainer(plan, resume=not args.fresh, progress=not args.no_progress).run()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GateFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except RunAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a policy with SFT warm start + RL (config: configs/*.yaml)")
    p.add_argument("config", help="run config YAML, e.g. configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (dotted key, YAML value); repeatable")
    p.add_argument("--fresh", action="store_true", help="start over even if output_dir holds a checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="print each stage's plan (learner ranks DP x CP, rollout workers and TP, resources, predicted "
                        "learner memory per rank) and whether the cluster can run it; start nothing")
    p.add_argument("--gpus", type=float, default=None, help="with --dry-run: plan for a cluster of this many GPUs")
    p.add_argument("--cpus", type=float, default=None, help="with --dry-run: ... and this many CPUs (default: enough)")
    p.set_defaults(func=run)
