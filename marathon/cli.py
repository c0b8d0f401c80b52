"""`marathon` command line. Each subcommand lives in ``marathon/commands/<name>.py`` and exposes
``register(subparsers)``; a module is listed here only once its command works end to end."""

from __future__ import annotations

import argparse
import importlib
import sys

from marathon import __version__

COMMANDS: tuple[str, ...] = ("env", "bench", "train", "eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marathon",
        description="Agentic RL post-training for long-context hybrid-attention MoE models "
        "(Ray + vLLM rollouts, DeepSpeed learner).",
    )
    parser.add_argument("--version", action="version", version=f"marathon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"marathon.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
