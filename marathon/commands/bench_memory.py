"""`marathon bench memory`: decoding-cache bytes per sequence for full MHA, GQA, MLA and the hybrid layout
at 8K / 64K / 256K / 1M tokens, for the real-shape presets (formulas in model/memory.py, checked against
real cache tensors in tests/test_model_memory.py), and the learner's predicted memory per rank for one packed
row of those lengths (weights, gradients, optimizer, saved activations with checkpointing, the largest layer's
transient; ``model.memory.learner_memory_bytes``, printed beside measurements by `marathon bench learner`).
Prints the tables, writes results.md and cache_bytes.png."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

LENGTHS = {"8K": 8192, "64K": 65536, "256K": 262144, "1M": 1048576}


def register(subparsers) -> None:
    parser = subparsers.add_parser("memory", help="KV/state cache bytes per sequence: MHA vs GQA vs MLA vs hybrid")
    parser.add_argument("--presets", default="kimi-linear-48b-a3b,marathon-93l-896e")
    parser.add_argument("--sliding-variant", default="LSLG",
                        help="also show each preset with this L/S/G layout (sliding window = preset's)")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes per cached K/V/latent value (bf16: 2)")
    parser.add_argument("--learner-presets", default="learner-bench,kimi-linear-48b-a3b",
                        help="presets whose learner memory per rank is predicted (bf16, checkpointing)")
    parser.add_argument("--zero-stage", type=int, default=3, help="ZeRO stage of the learner prediction")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (ZeRO shards over them)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (a row is split over them)")
    parser.add_argument("--out", default="benchmarks/memory")
    parser.set_defaults(func=main)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def table(presets: list[str], sliding_variant: str, kv_bytes: int) -> dict[str, dict[str, dict[str, int]]]:
    """{preset title: {design: {length label: bytes}}}"""
    from model.config import MarathonConfig
    from model.memory import cache_bytes, design_cache_bytes, designs_summary, layout_summary

    out = {}
    for name in presets:
        cfg = MarathonConfig.from_preset(name)
        variant = MarathonConfig.from_preset(name, layer_layout=sliding_variant) if sliding_variant else None
        rows: dict[str, dict[str, int]] = {}
        for label, tokens in LENGTHS.items():
            for design, b in design_cache_bytes(cfg, tokens, kv_bytes).items():
                design = f"hybrid {layout_summary(cfg)}" if design == "hybrid" else design
                rows.setdefault(design, {})[label] = b
            if variant is not None:
                rows.setdefault(f"hybrid {sliding_variant}: {layout_summary(variant)}", {})[label] = cache_bytes(
                    variant, tokens, kv_bytes
                )
        out[f"{name}, {cfg.num_hidden_layers} layers ({designs_summary(cfg)})"] = rows
    return out


def learner_lines(presets: list[str], zero_stage: int, dp: int, cp: int) -> list[str]:
    """Markdown tables of the predicted learner memory per rank, one per preset."""
    from model.config import MarathonConfig
    from model.memory import learner_memory_bytes

    lines = []
    for name in presets:
        cfg = MarathonConfig.from_preset(name)
        pred = {label: learner_memory_bytes(cfg, tokens, zero_stage=zero_stage, dp=dp, cp=cp)
                for label, tokens in LENGTHS.items()}
        lines += [f"### learner memory per rank: {name} (bf16 + fp32 AdamW, ZeRO-{zero_stage}, DP {dp}, CP {cp}, "
                  "gradient checkpointing; one packed row of each length)", "",
                  "| part | " + " | ".join(LENGTHS) + " |", "|---" * (len(LENGTHS) + 1) + "|"]
        lines += [f"| {part} | " + " | ".join(_fmt(pred[k][part]) for k in LENGTHS) + " |"
                  for part in next(iter(pred.values()))]
        lines.append("")
    return lines


def main(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p in args.presets.split(",") if p]
    results = table(presets, args.sliding_variant, args.kv_bytes)
    lines = [f"Command: `marathon bench {shlex.join(sys.argv[2:] if len(sys.argv) > 2 else ['memory'])}`", "",
             f"Cache bytes per sequence (K/V/latent {args.kv_bytes} B per value, linear-attention states fp32).", ""]
    for preset, rows in results.items():
        lines += [f"### {preset}", "", "| design | " + " | ".join(LENGTHS) + " |", "|---" * (len(LENGTHS) + 1) + "|"]
        lines += [f"| {d} | " + " | ".join(_fmt(v[k]) for k in LENGTHS) + " |" for d, v in rows.items()]
        lines.append("")
    lines += learner_lines([p for p in args.learner_presets.split(",") if p], args.zero_stage, args.dp, args.cp)
    text = "\n".join(lines)
    print(text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    xs = list(LENGTHS.values())
    for ax, (preset, rows) in zip(axes[0], results.items()):
        for design, v in rows.items():
            ax.loglog(xs, [v[k] / 2**30 for k in LENGTHS], marker="o", label=design)
        ax.set_xticks(xs, list(LENGTHS))
        ax.set_title(preset.split(" (")[0], fontsize=9)
        ax.set_xlabel("tokens per sequence")
        ax.set_ylabel("cache GiB per sequence")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cache_bytes.png", dpi=120)
    print(f"wrote {out / 'results.md'} and {out / 'cache_bytes.png'}")
    return 0
