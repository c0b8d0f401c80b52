"""Run metrics: one row per step to CSV and TensorBoard, and a PNG plot of reward and success.

Rows are kept in memory and saved in checkpoints, so a resumed run rewrites the CSV from the checkpoint's rows
and TensorBoard purges events logged after the checkpoint's step (``purge_step``): the files show one clean
trajectory either way.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, out_dir: str | Path, rows: list[dict[str, Any]] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = list(rows or [])
        purge = self.rows[-1]["step"] + 1 if self.rows else None
        self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=purge)
        self._write_csv()

    @property
    def csv_path(self) -> Path:
        return self.dir / "metrics.csv"

    def log(self, row: dict[str, Any]) -> None:
        """``row`` needs ``step``; numeric values also go to TensorBoard under their key."""
        self.rows.append(row)
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        self._write_csv()

    def add_to_last(self, values: dict[str, float]) -> None:
        """Add values (e.g. an evaluation's result) to the last row."""
        row = self.rows[-1]
        row.update(values)
        for k, v in values.items():
            self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        self._write_csv()

    def _write_csv(self) -> None:
        keys: list[str] = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        tmp = self.csv_path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        tmp.replace(self.csv_path)

    def plot(self) -> Path:
        """reward and success per RL step, held-out success at each evaluation: ``plot.png``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
        rl = [r for r in self.rows if r.get("phase") == "rl"]
        ev = [r for r in self.rows if "eval/success" in r]
        if rl:
            steps = [r["step"] for r in rl]
            ax_r.plot(steps, [r["reward_mean"] for r in rl], label="train reward (mean)")
            ax_s.plot(steps, [r["success_rate"] for r in rl], label="train success")
        if ev:
            ax_s.plot([r["step"] for r in ev], [r["eval/success"] for r in ev], "o-", label="held-out success")
        sft = [r for r in self.rows if r.get("phase") == "sft"]
        if sft:
            ax_r.axvline(sft[-1]["step"], color="gray", ls="--", lw=1, label="end of SFT")
            ax_s.axvline(sft[-1]["step"], color="gray", ls="--", lw=1)
        ax_r.set(xlabel="step", ylabel="reward", title="reward")
        ax_s.set(xlabel="step", ylabel="success rate", title="success", ylim=(-0.02, 1.02))
        for ax in (ax_r, ax_s):
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = self.dir / "plot.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.tb.close()
