"""``marathon eval CONFIG --checkpoint DIR``: held-out success rate of a trained policy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def resolve_checkpoint(path: str) -> Path:
    """An HF policy dir, a run's ``checkpoint`` dir (its ``policy``) or a run dir (``final``, else the checkpoint)."""
    from configs.schema import ConfigError

    p = Path(path)
    for cand in (p, p / "policy", p / "final", p / "checkpoint" / "policy"):
        if (cand / "config.json").is_file():
            return cand
    raise ConfigError(f"--checkpoint {path}: no HF policy checkpoint there (looked for config.json in it, "
                      "policy/, final/ and checkpoint/policy/)")


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError
    from marathon.driver import evaluate_checkpoint, prepare

    try:
        plan = prepare(args.config)
        model_dir = resolve_checkpoint(args.checkpoint)
        names = [s.name for s in plan.stages]
        if args.stage is not None and args.stage not in names:
            raise ConfigError(f"--stage {args.stage}: unknown stage; known: {names}")
        stage = plan.stages[names.index(args.stage) if args.stage else -1]
        result = evaluate_checkpoint(plan, model_dir, stage, num_seeds=args.num_seeds, temperature=args.temperature)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="success rate of a checkpoint on held-out seeds")
    p.add_argument("config", help="the run config (env, episode limits, evaluation settings)")
    p.add_argument("--checkpoint", required=True, help="HF policy dir, run checkpoint dir, or run output dir")
    p.add_argument("--num-seeds", type=int, default=None, help="held-out seeds (default: eval.num_seeds)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0 greedy "
                   "(default: eval.temperature)")
    p.add_argument("--stage", default=None, help="stage whose episode limits apply (default: the last)")
    p.set_defaults(func=run)
