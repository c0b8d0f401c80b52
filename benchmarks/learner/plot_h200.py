"""Plot the second H200 lease's `marathon bench learner` results (`h200/steady-2.json`, `single-1m.json`,
`global-512k.json`): one RL update's time and peak memory against tokens, per layout and case.

    python benchmarks/learner/plot_h200.py        # -> benchmarks/learner/h200/learner.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

H200 = Path(__file__).resolve().parent / "h200"
FILES = ["steady-2.json", "single-1m.json", "global-512k.json"]
DEVICE_GIB = 139.8  # the H200's memory as torch reports it


def rows() -> list[dict]:
    out = []
    for name in FILES:
        out += [r for r in json.loads((H200 / name).read_text())["rows"] if "seconds" in r]
    return out


def main() -> None:
    data = rows()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for layout, color in (("hybrid", "tab:blue"), ("global", "tab:red")):
        for case, marker in (("packed", "o"), ("single", "s")):
            pts = sorted((r["tokens"], r["seconds"], r["peak_gib"]) for r in data
                         if r["layout"] == layout and r["case"] == case)
            if not pts:
                continue
            label = f"{layout} ({'all MLA' if layout == 'global' else 'LLSG'}), {case}"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label,
                      linestyle="-" if case == "single" else "--")
            ax_m.plot([p[0] for p in pts], [p[2] for p in pts], marker=marker, color=color, label=label,
                      linestyle="-" if case == "single" else "--")
    ax_t.set(xscale="log", yscale="log", xlabel="tokens in the update", ylabel="seconds per RL update",
             title="learner-bench (1.9B) on one H200")
    ax_m.axhline(DEVICE_GIB, color="grey", linewidth=0.8, linestyle=":")
    ax_m.set(xscale="log", xlabel="tokens in the update", ylabel="peak GiB (max_memory_allocated)",
             title="peak memory (1M and 512K singles: inputs offloaded)", ylim=(0, 150))
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(H200 / "learner.png", dpi=120)
    print(H200 / "learner.png")


if __name__ == "__main__":
    main()
