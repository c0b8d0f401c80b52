"""Checkpoints that cannot vanish (issue 15): a save killed at any of its steps leaves a complete checkpoint
that the next start finds (the newest complete one); metrics.csv is only ever appended to.

The store is killed (``os._exit``, no clean-up of any kind) at every point of ``SAVE_POINTS`` in a child
process; the slow test kills `marathon train` itself at points of a real save and resumes it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marathon.checkpoint import FAULT_ENV, FAULT_EXIT, MANIFEST, SAVE_POINTS, CheckpointStore
from marathon.metrics import MetricsLog, read_rows

ROOT = Path(__file__).resolve().parent.parent

# The child: one save of "step 2" into OUT, shaped like the driver's (learner/, policy/, driver.pt), with the
# driver's own fault points between its parts.
CHILD = """
import json, sys
from pathlib import Path
from marathon.checkpoint import CheckpointStore, fault_point

def write(tmp: Path) -> None:
    (tmp / "learner").mkdir()
    (tmp / "learner" / "state.bin").write_bytes(b"L" * 100_000)
    fault_point("learner")
    (tmp / "policy").mkdir()
    (tmp / "policy" / "config.json").write_text("{}")
    fault_point("policy")
    (tmp / "driver.pt").write_text(json.dumps({"step": 2}))

CheckpointStore(sys.argv[1]).save(write)
"""


def _write(step: int):
    def write(tmp: Path) -> None:
        (tmp / "learner").mkdir()
        (tmp / "learner" / "state.bin").write_bytes(b"L" * 100_000)
        (tmp / "policy").mkdir()
        (tmp / "policy" / "config.json").write_text("{}")
        (tmp / "driver.pt").write_text(json.dumps({"step": step}))

    return write


def _step(ckpt: Path) -> int:
    return json.loads((ckpt / "driver.pt").read_text())["step"]


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_a_save_killed_at_any_point_leaves_a_complete_checkpoint(tmp_path, point):
    store = CheckpointStore(tmp_path)
    store.save(_write(1))
    env = {**os.environ, FAULT_ENV: point, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True)
    assert proc.returncode == FAULT_EXIT, proc.stderr  # it really died at that point
    latest = store.latest()
    committed = SAVE_POINTS.index(point) >= SAVE_POINTS.index("renamed")
    assert latest is not None and _step(latest) == (2 if committed else 1)
    assert store.verify(latest) is None and (latest / "learner" / "state.bin").stat().st_size == 100_000
    assert all(store.verify(d) is None for d in store.complete())
    # the next save clears what the killed one left and completes; one checkpoint remains, the link points at it
    store.save(_write(3))
    assert [_step(d) for d in store.complete()] == [3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [store.latest().name]
    assert _step(tmp_path / "checkpoint") == 3


def test_partial_and_damaged_checkpoints_are_ignored(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.latest() is None
    first = store.save(_write(1))
    second = store.save(_write(2))
    assert not first.exists() and store.latest() == second
    (tmp_path / "checkpoints" / ".tmp-ckpt-000009").mkdir()  # a save in progress: never a candidate
    (tmp_path / "checkpoints" / "ckpt-000010").mkdir()  # no manifest
    assert store.latest() == second
    with open(second / "learner" / "state.bin", "r+b") as f:  # truncated after the fact
        f.truncate(10)
    assert "does not match" in store.verify(second) and store.latest() is None
    json.loads((second / MANIFEST).read_text())


def test_the_previous_layout_is_still_found(tmp_path):
    """A run dir written before: a save killed between its two renames left only checkpoint.old/."""
    old = tmp_path / "checkpoint.old"
    old.mkdir()
    (old / "driver.pt").write_text(json.dumps({"step": 7}))
    (tmp_path / "checkpoint.tmp").mkdir()  # the unfinished new one: ignored
    store = CheckpointStore(tmp_path)
    assert store.latest() == old
    store.save(_write(8))
    assert [_step(d) for d in store.complete()] == [8] and not old.exists()
    assert (tmp_path / "checkpoint").is_symlink()


# -- metrics.csv -------------------------------------------------------------------------------------------------
def _row(step: int, **extra):
    return {"step": step, "phase": "rl", "reward_mean": step / 10, **extra}


def test_metrics_csv_is_append_only_across_resumes(tmp_path):
    log = MetricsLog(tmp_path)
    for s in range(3):
        log.log(_row(s))
    log.add_to_last({"eval/success": 0.5})
    log.flush()  # a checkpoint here holds rows 0..2
    checkpoint_rows = [dict(r) for r in log.rows]
    log.log(_row(3))
    log.log(_row(4))  # row 3 is on file; row 4 pending when the process is killed (no close)
    on_file = read_rows(tmp_path / "metrics.csv", all_attempts=True)
    assert [r["step"] for r in on_file] == ["0", "1", "2", "3"] and on_file[2]["eval/success"] == "0.5"

    resumed = MetricsLog(tmp_path, checkpoint_rows)  # the resumed run redoes steps 3.. with a new attempt
    assert resumed.attempt == 2
    for s in (3, 4, 5):
        resumed.log(_row(s, new_column=s))  # a new column: the header widens, no row is lost
    resumed.close()
    every = read_rows(tmp_path / "metrics.csv", all_attempts=True)
    assert [(r["step"], r["attempt"]) for r in every] == [("0", "1"), ("1", "1"), ("2", "1"), ("3", "1"),
                                                         ("3", "2"), ("4", "2"), ("5", "2")]
    trajectory = read_rows(tmp_path / "metrics.csv")
    assert [(r["step"], r["attempt"]) for r in trajectory] == [("0", "1"), ("1", "1"), ("2", "1"), ("3", "2"),
                                                              ("4", "2"), ("5", "2")]
    assert trajectory[3]["new_column"] == "3" and trajectory[0]["new_column"] == ""


def test_rows_a_checkpoint_holds_come_back_to_an_emptied_csv(tmp_path):
    """An older version rewrote metrics.csv from the checkpoint, and emptied it when none was found."""
    (tmp_path / "metrics.csv").write_text("step,phase\n")
    log = MetricsLog(tmp_path, [_row(0), _row(1)])
    log.close()
    with open(tmp_path / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1"]


# -- the driver, killed during its saves ---------------------------------------------------------------------
SMALL = {"steps": 4, "sft.steps": 1, "sft.num_demos": 16, "sft.batch_size": 8, "eval.num_seeds": 4,
         "eval.every": 0, "rollout.prompts_per_step": 2, "rollout.group_size": 4, "checkpoint_every": 2,
         # exact resume needs an engine that honours per-request seeds: the tiny Qwen3 (README, "Training runs")
         "model.source": "tiny-qwen3"}
DETERMINISTIC = ("step", "phase", "reward_mean", "success_rate", "episode_tokens", "model_tokens", "loss",
                 "grad_norm", "trained_episodes", "version", "eval/success")


def _train(config: Path, out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    args = [a for k, v in {**SMALL, "output_dir": str(out)}.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "marathon.cli", "train", str(config), "--no-progress", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def frozen_config(tmp_path_factory) -> Path:
    """A frozen copy of the tiny config: every run and resume sees the same one."""
    config = tmp_path_factory.mktemp("config") / "tiny.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text())
    return config


@pytest.fixture(scope="module")
def reference_run(frozen_config, tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("ref") / "run"
    proc = _train(frozen_config, ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("point", ["learner", "synced", "retired"])
def test_the_driver_killed_during_a_save_resumes_the_same_run(frozen_config, reference_run, tmp_path, point):
    """Saves: 1 after SFT, 2 at RL step 2, then the final one. The driver dies at ``point`` of the second (the
    newest complete checkpoint is then the SFT one, or the new one from "renamed" on); started again it resumes
    from the newest complete checkpoint and ends with the trajectory of an uninterrupted run."""
    config, ref = frozen_config, reference_run
    cut = tmp_path / "cut"
    killed = _train(config, cut, f"{point}@2")
    assert killed.returncode == FAULT_EXIT, killed.stderr[-3000:]
    resumed = _train(config, cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    a, b = read_rows(ref / "metrics.csv"), read_rows(cut / "metrics.csv")
    assert len(a) == len(b) == 5
    for ra, rb in zip(a, b):
        for k in DETERMINISTIC:
            assert ra.get(k) == rb.get(k), (point, ra["step"], k, ra.get(k), rb.get(k))
    state = torch.load(cut / "checkpoint" / "driver.pt", weights_only=False)["state"]
    assert state["finished"] and state["data_pos"] == 8 and [r["step"] for r in state["rows"]] == [0, 1, 2, 3, 4]
    assert len(list((cut / "checkpoints").iterdir())) == 1
