"""Run metrics: one row per step to CSV and TensorBoard, and a PNG plot of reward and success.

``rows`` (in memory, saved in checkpoints) is the run's trajectory: a resumed run starts from the checkpoint's
rows, and TensorBoard purges events logged after the checkpoint's step (``purge_step``).

``metrics.csv`` is append-only across resumes: a row goes to the end of the file once it is complete (when the
next row comes, at each checkpoint, ``flush``, and at ``close``; ``add_to_last`` completes the pending one), and
nothing already there is ever removed. Its ``attempt`` column says which start of the run wrote a row (1, then
+1 per resume or in-process restart): after a resume, the steps between the checkpoint and the crash appear
again, and the later row of a step is the one the run continued from (``read_rows`` gives that view). A row
with a new column widens the header by rewriting the file atomically with every row it held.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any


def read_rows(path: str | Path, all_attempts: bool = False) -> list[dict[str, str]]:
    """The rows of a ``metrics.csv``: for each step the last one written (the trajectory the run continued),
    in step order; ``all_attempts``: every row as written."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if all_attempts:
        return rows
    last = {r["step"]: r for r in rows}
    return sorted(last.values(), key=lambda r: int(r["step"]))


class MetricsLog:
    def __init__(self, out_dir: str | Path, rows: list[dict[str, Any]] | None = None) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = list(rows or [])
        self._pending: dict[str, Any] | None = None
        self._keys: list[str] = []
        self.attempt = 1
        if self.csv_path.is_file() and self.csv_path.stat().st_size:
            on_file = read_rows(self.csv_path, all_attempts=True)
            with open(self.csv_path, newline="") as f:
                self._keys = next(csv.reader(f), [])
            self.attempt = 1 + max((int(r["attempt"]) for r in on_file if r.get("attempt", "").isdigit()), default=0)
            seen = {r["step"] for r in on_file}
            missing = [r for r in self.rows if str(r["step"]) not in seen]  # e.g. emptied by an older version
        else:
            missing = self.rows
        for r in missing:
            self._append({"step": r["step"], "attempt": self.attempt, **r})
        self._open_tb(self.rows[-1]["step"] + 1 if self.rows else None)

    def _open_tb(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.dir / "tb"), purge_step=purge_step)

    @property
    def csv_path(self) -> Path:
        return self.dir / "metrics.csv"

    def log(self, row: dict[str, Any]) -> None:
        """``row`` needs ``step``; numeric values also go to TensorBoard under their key."""
        self.flush()
        self.rows.append(row)
        self._pending = row
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()

    def add_to_last(self, values: dict[str, float]) -> None:
        """Add values (e.g. an evaluation's result) to the last row."""
        row = self.rows[-1]
        row.update(values)
        for k, v in values.items():
            self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        if self._pending is not row:  # already on file (a checkpoint came between): the completed row again
            self._pending = row

    def flush(self) -> None:
        """Append the pending row to ``metrics.csv`` (durably)."""
        if self._pending is not None:
            row, self._pending = self._pending, None
            self._append({"step": row["step"], "attempt": self.attempt, **row})

    def rewind(self, rows: list[dict[str, Any]]) -> None:
        """Go back to a checkpoint's ``rows`` within this process (an actor died): a new attempt."""
        self._pending = None
        self.rows = list(rows)
        self.attempt += 1
        self.tb.close()
        self._open_tb(self.rows[-1]["step"] + 1 if self.rows else 0)

    def _append(self, row: dict[str, Any]) -> None:
        new = [k for k in row if k not in self._keys]
        if new or not self.csv_path.is_file():
            old = read_rows(self.csv_path, all_attempts=True) if self.csv_path.is_file() else []
            self._keys += new
            tmp = self.csv_path.with_suffix(".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self._keys)
                w.writeheader()
                w.writerows(old + [row])
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.csv_path)
            return
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._keys).writerow(row)
            f.flush()
            os.fsync(f.fileno())

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
        self.flush()
        self.tb.close()
