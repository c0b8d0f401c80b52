"""Env faults are data, `marathon env check` checks more, the learner may die (issue 15).

Each fault is injected and the run (or the rollout) is shown to go on with nothing lost or counted twice:
- the guard (``envs/guard.py``): an env that raises in make/reset/step, hangs, or returns malformed values;
- the episode runner: such episodes end as infra failures, every episode returns exactly once;
- the driver's scoring: infra-failed episodes (and a reward term returning NaN) leave their group's advantage,
  the rest of the group is renormalised;
- the restart loop: an actor dying mid-stage rewinds to the last checkpoint (bounded), rows appended as a new
  attempt; the slow test kills a real learner mid-update in a run of a plugin env registered the plain
  gymnasium way (default wrappers) with SFT, hangs and exceptions.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import gymnasium
import pytest
import torch

import envs
import envs.guard as guard
from configs.schema import ConfigError, LossSection
from envs.arithmetic import ArithmeticEnv
from envs.check import check_env
from envs.guard import GuardedEnv, abandoned_calls, call_limited
from marathon.metrics import read_rows

ROOT = Path(__file__).resolve().parent.parent
RELEASE = threading.Event()  # set at the end of the module: hung env calls return


@pytest.fixture(scope="module", autouse=True)
def _release_hung_calls():
    yield
    RELEASE.set()


class FaultyArithmetic(ArithmeticEnv):
    """Arithmetic with faults on RL training seeds (below 10**8; SFT and held-out seeds are far above):
    ``faults`` maps a seed to ``reset`` (reset raises), ``step`` (the first step raises), ``hang`` (the first
    step blocks until the module ends) or ``shape`` (the first step returns a 4-tuple). ``once``: a file whose
    existence makes the next reset of seed ``once_seed`` raise (once: it removes the file)."""

    def __init__(self, faults: dict | None = None, once: str | None = None, once_seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.faults, self.once, self.once_seed = {int(k): v for k, v in (faults or {}).items()}, once, once_seed
        self.fault, self.stepped = None, False

    def reset(self, *, seed=None, options=None):
        self.fault, self.stepped = self.faults.get(seed) if seed is not None and seed < 10**8 else None, False
        if self.fault == "reset":
            raise RuntimeError(f"reset of seed {seed} broke")
        if self.once and seed == self.once_seed and os.path.exists(self.once):
            os.remove(self.once)
            raise OSError("the env's backing service went away")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        first, self.stepped = not self.stepped, True
        if first and self.fault == "step":
            raise KeyError("step broke")
        if first and self.fault == "hang":
            RELEASE.wait(300)
        if first and self.fault == "shape":
            return {"messages": []}, 0.0, True, {}
        return super().step(action)


FAULTY = "marathon-test/Faulty-v0"
gymnasium.register(FAULTY, entry_point=FaultyArithmetic)  # the plain way: OrderEnforcing + env checker


def _abandoned_threads() -> set[threading.Thread]:
    abandoned_calls()  # prunes the threads that have ended
    return set(guard._abandoned)


# -- the guard ---------------------------------------------------------------------------------------------------
def test_guard_turns_exceptions_hangs_and_bad_shapes_into_terminal_steps():
    env = GuardedEnv.make(FAULTY, {"faults": {1: "step"}}, timeout_s=5)
    obs, info = env.reset(seed=1)
    assert "infra_failure" not in info and obs["messages"]
    obs, reward, terminated, truncated, info = env.step("Final answer: 3")
    f = info["infra_failure"]
    assert terminated and not truncated and info["success"] is False and obs == {"messages": []}
    assert (f["kind"], f["call"]) == ("exception", "step") and "KeyError: 'step broke'" in f["message"]
    assert "raise KeyError" in f["traceback"]
    assert env.step("again")[4]["infra_failure"] is f  # the env is not called again
    env.close()

    env = GuardedEnv.make(FAULTY, {"faults": {2: "reset"}}, timeout_s=5)
    obs, info = env.reset(seed=2)
    assert obs == {"messages": [], "tools": []} and info["infra_failure"]["call"] == "reset"
    assert "reset of seed 2 broke" in info["infra_failure"]["message"]

    env = GuardedEnv.make(FAULTY, {"faults": {3: "shape"}}, timeout_s=5)
    env.reset(seed=3)
    f = env.step("x")[4]["infra_failure"]
    assert f["kind"] == "contract" and "(obs, reward, terminated, truncated, info)" in f["message"]

    before = _abandoned_threads()
    env = GuardedEnv.make(FAULTY, {"faults": {4: "hang"}}, timeout_s=0.5)
    env.reset(seed=4)
    t0 = time.perf_counter()
    f = env.step("Final answer: 1")[4]["infra_failure"]
    assert time.perf_counter() - t0 < 3 and f["kind"] == "timeout" and "0.5 s limit" in f["message"]
    assert "RELEASE.wait(300)" in f["traceback"]  # the hung thread's stack names the line
    # the hung call is counted (a difference of counts would be flaky: another test's abandoned thread may end
    # in between)
    new = _abandoned_threads() - before
    assert len(new) == 1 and abandoned_calls() >= 1
    env.close()  # in the background: does not block on the stuck env

    env = GuardedEnv.make("marathon/Nope-v0", timeout_s=5)
    f = env.reset(seed=0)[1]["infra_failure"]
    assert (f["kind"], f["call"]) == ("exception", "make") and "unknown environment id" in f["message"]


def test_call_limited_reports_system_exit_and_values():
    assert call_limited(lambda: 7, timeout_s=1).value == 7 and call_limited(lambda: 7, timeout_s=None).ok
    out = call_limited(lambda: exit(3), timeout_s=1)
    assert isinstance(out.error, SystemExit) and not out.ok
    # arguments never collide with the limit's own keywords (a tool parameter called "name", an env option
    # called "timeout_s")
    out = call_limited(lambda name, timeout_s: (name, timeout_s), (), {"name": "x", "timeout_s": 3}, timeout_s=1)
    assert out.value == ("x", 3)
    env = GuardedEnv.make("marathon/CodeSandbox-v0", {"timeout_s": 1.0}, timeout_s=30)
    assert "infra_failure" not in env.reset(seed=0)[1]
    env.close()


# -- the runner --------------------------------------------------------------------------------------------------
def _fake_worker_class(stop_id: int) -> type:
    class FakeWorker:
        """No engine: every turn is the same final answer (then the stop id)."""

        def __init__(self):
            self.version = 0

        def ready(self):
            return {"pid": os.getpid(), "version": self.version}

        def generate(self, requests):
            from rollout.worker import GenResult

            return [GenResult(r.request_id, [70, 71, 72, stop_id], [-1.0] * 4, "stop", self.version, None)
                    for r in requests]

    return FakeWorker


@pytest.fixture(scope="module")
def codec():
    from model.tokenizer import train_tokenizer
    from rollout.chat import ChatCodec

    return ChatCodec(train_tokenizer())


def test_runner_ends_faulty_episodes_as_infra_failures_and_loses_none(ray_local, codec, tmp_path):
    from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig, WorkerPool

    once = tmp_path / "once"
    once.touch()
    kwargs = {"faults": {1: "step", 2: "hang", 3: "reset", 4: "shape"}, "once": str(once), "once_seed": 5}
    worker = ray_local.remote(_fake_worker_class(codec.eos_id)).options(num_cpus=0).remote()
    try:
        runner = EpisodeRunner(WorkerPool([worker]), codec, RolloutConfig(max_new_tokens=8, env_timeout_s=1.0))
        specs = [EpisodeSpec(f"e{s}-{g}", FAULTY, s, kwargs, sampling_seed=g) for s in range(6) for g in range(2)]
        t0 = time.perf_counter()
        trajs = runner.run(specs)
        assert time.perf_counter() - t0 < 60  # the hanging steps (300 s) were cut at their 1 s limit
    finally:
        ray_local.kill(worker)
    assert [t.episode_id for t in trajs] == [s.episode_id for s in specs]  # each exactly once, in order
    kinds = {t.episode_id: (t.info["infra_failure"] or {}).get("kind") for t in trajs}
    for g in range(2):
        assert kinds[f"e1-{g}"] == "exception" and kinds[f"e2-{g}"] == "timeout"
        assert kinds[f"e3-{g}"] == "exception" and kinds[f"e4-{g}"] == "contract"
    # the once-fault hit exactly one of the otherwise healthy episodes, at reset: no tokens at all
    once_hit = [t for t in trajs if t.seed == 5 and t.info["infra_failure"]]
    assert len(once_hit) == 1 and once_hit[0].token_ids == [] and not once.exists()
    assert once_hit[0].info["infra_failure"]["call"] == "reset"
    healthy = [t for t in trajs if not t.info["infra_failure"]]
    assert len(healthy) == 3 and all(t.info["finish"] == "terminated" and t.num_turns == 1 for t in healthy)
    assert all(t.info["finish"] == "infra_failure" and not t.success for t in trajs if t.info["infra_failure"])
    assert runner.stats.infra_failures == 9


# -- scoring and advantages -------------------------------------------------------------------------------------
def test_infra_failed_episodes_leave_the_advantage_and_the_group_is_renormalised():
    from learner.losses import group_advantages
    from marathon.driver import episode_advantages

    for loss in (LossSection(advantage="grpo"), LossSection(advantage="rloo")):
        rewards = [1.0, 0.0, 0.5, 0.0, None, 1.0, 0.0, 0.0, None, None, None, 1.0]  # groups of 4
        adv = episode_advantages(rewards, 4, loss)
        full = group_advantages(torch.tensor(rewards[:4]), 4, loss.advantage, loss.grpo_scale_std).tolist()
        assert adv[:4] == full  # a group without failures: exactly as before
        part = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, loss.advantage, loss.grpo_scale_std).tolist()
        assert adv[4] is None and adv[5:8] == part  # renormalised over the 3 that remain
        assert adv[8:] == [None] * 4  # one member left: no baseline, the group is dropped


def _traj(i, success=True, failure=None, terms=None):
    from rollout.types import Trajectory

    info = {"env": {"success": success, "format_errors": 0, **(terms or {})}, "infra_failure": failure}
    return Trajectory(f"t{i}", FAULTY, i, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1, num_turns=1,
                      success=success, info=info)


def test_a_reward_term_returning_nan_marks_its_episode(tmp_path, monkeypatch):
    from marathon.driver import score_episodes
    from rewards import load_reward_config

    (tmp_path / "nan_terms.py").write_text(
        "def odd(info, num_model_tokens, num_turns):\n    return float('nan') if info.get('odd') else 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "r.yaml"
    path.write_text("terms:\n  success: {weight: 1}\n  odd: {weight: 0.5, function: 'nan_terms:odd'}\n")
    reward = load_reward_config(path)
    trajs = [_traj(0), _traj(1, terms={"odd": True}), _traj(2, failure={"kind": "timeout", "message": "m"})]
    rewards = score_episodes(trajs, reward)
    assert rewards == [1.5, None, None] and trajs[0].reward_terms == {"success": 1.0, "odd": 0.5}
    f = trajs[1].info["infra_failure"]
    assert f["kind"] == "reward" and "reward term 'odd' returned nan" in f["message"] and "nan_terms:odd" in f["message"]


# -- env check ---------------------------------------------------------------------------------------------------
class Shared(ArithmeticEnv):
    """Keeps the episode's task in a class attribute and quotes it in tool messages: right when one instance
    plays at a time, wrong when instances step side by side."""

    task = None

    def reset(self, *, seed=None, options=None):
        out = super().reset(seed=seed, options=options)
        Shared.task = out[0]["messages"][1]["content"]
        return out

    def step(self, action):
        time.sleep(0.02)  # let another instance reset meanwhile
        obs, *rest = super().step(action)
        return ({"messages": [{**m, "content": f"{m['content']} ({Shared.task})"} for m in obs["messages"]]}, *rest)


class Drifting(ArithmeticEnv):
    """Tool results depend on how many episodes the instance has played."""

    episodes = 0

    def reset(self, *, seed=None, options=None):
        self.episodes += 1
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, *rest = super().step(action)
        obs = {"messages": [{**m, "content": m["content"] + "." * self.episodes} for m in obs["messages"]]}
        return (obs, *rest)


class Hanging(ArithmeticEnv):
    def step(self, action):
        if "calculator" in action:
            RELEASE.wait(300)
        return super().step(action)


class Wordy(ArithmeticEnv):
    def _new_task(self, options):
        msgs = super()._new_task(options)
        return [msgs[0], {**msgs[1], "content": msgs[1]["content"] + " please" * 400}]


for _cls in (Shared, Drifting, Hanging, Wordy):
    envs.register(f"marathon-test/{_cls.__name__}-v0", _cls)


def test_env_check_finds_hangs_drift_shared_state_and_oversized_prompts():
    seeds = list(range(6))
    assert check_env("marathon/Arithmetic-v0", seeds=seeds).ok
    assert check_env(FAULTY, seeds=seeds).ok  # the plain gymnasium registration checks like ours

    t0 = time.perf_counter()
    report = check_env("marathon-test/Hanging-v0", seeds=seeds, timeout_s=0.5)
    assert time.perf_counter() - t0 < 10
    assert any(p.startswith("hangs: step(") and "0.5 s" in p and "RELEASE.wait(300)" in p for p in report.problems)

    report = check_env("marathon-test/Drifting-v0", seeds=seeds)
    assert any("not deterministic: seed" in p and "same actions" in p for p in report.problems), report.problems

    report = check_env("marathon-test/Shared-v0", seeds=seeds, threads=6)
    assert [p for p in report.problems if "concurrently from threads interfere" in p], report.problems
    assert check_env("marathon-test/Shared-v0", seeds=seeds, threads=1).ok  # alone it is fine

    report = check_env("marathon-test/Wordy-v0", seeds=seeds[:2], context_tokens=512)
    assert any("the opening prompt (~" in p and "does not fit the context budget of 512" in p for p in report.problems)
    assert any(n.startswith("sizes: opening prompt up to") for n in report.notes)


# -- gymnasium-registered plugins in train -----------------------------------------------------------------------
def test_sft_demos_from_a_plain_gymnasium_registration(codec):
    """`gymnasium.register` wraps the env in OrderEnforcing, which does not forward `oracle_action` (gymnasium
    1.x): the SFT demos read it from the env itself, as `marathon env check` does."""
    from marathon.demos import build_demos

    assert isinstance(envs.make(FAULTY), gymnasium.Wrapper)
    demos = build_demos(FAULTY, {"faults": {900_000_001: "step"}}, [900_000_000, 900_000_001], codec, 256)
    assert len(demos) == 2 and all(sum(r["loss_mask"]) > 0 for r in demos)


class NoOracle(gymnasium.Env):
    def reset(self, *, seed=None, options=None):
        return {"messages": [{"role": "user", "content": "hi"}], "tools": []}, {}

    def step(self, action):
        return {"messages": []}, 0.0, True, False, {"success": False}


gymnasium.register("marathon-test/NoOracle-v0", entry_point=NoOracle)


def test_prepare_refuses_sft_without_an_oracle_before_any_work(tmp_path):
    from marathon.driver import prepare

    sets = {"env.id": "marathon-test/NoOracle-v0", "env.kwargs": {}, "output_dir": str(tmp_path / "run")}
    with pytest.raises(ConfigError, match=r"sft.steps: marathon-test/NoOracle-v0 has no oracle_action"):
        prepare(ROOT / "configs" / "tiny.yaml", sets)
    assert not (tmp_path / "run").exists()
    assert prepare(ROOT / "configs" / "tiny.yaml", {**sets, "sft.steps": 0}).cfg.sft.steps == 0


# -- the restart loop --------------------------------------------------------------------------------------------
def _fake_stage(die_at: set):
    """A `_run_stage` without actors: one row per step, a checkpoint (driver state only) after each; raises
    ActorDiedError when it reaches a step in ``die_at`` (removing it: each death once)."""
    import ray

    def run_stage(self, state, stage, first):
        while state.stage_step < stage.steps:
            if state.step in die_at:
                die_at.discard(state.step)
                raise ray.exceptions.ActorDiedError()
            state.data_pos += stage.prompts_per_step
            state.stage_step += 1
            self._row(state, {"phase": "rl", "stage": stage.name, "reward_mean": 0.5, "success_rate": 0.5,
                              "data_pos": state.data_pos})
            self._save(state, with_learner=False)
        state.stage_index += 1

    return run_stage


def test_an_actor_death_rewinds_to_the_checkpoint_and_retries_are_bounded(ray_local, tmp_path, monkeypatch):
    from marathon.driver import Trainer, prepare

    sets = {"steps": 5, "sft.steps": 0, "output_dir": str(tmp_path / "run"), "learner.max_restarts": 2}
    monkeypatch.setattr(Trainer, "_export", lambda self, path, overrides=None: Path(path))
    monkeypatch.setattr(Trainer, "_run_stage", _fake_stage({2, 4}))
    summary = Trainer(prepare(ROOT / "configs" / "tiny.yaml", sets), progress=False).run()
    assert summary["actor_restarts"] == 2 and summary["step"] == 5
    out = tmp_path / "run"
    rows = read_rows(out / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [int(r["data_pos"]) for r in rows] == [16, 32, 48, 64, 80]  # nothing counted twice
    state = torch.load(out / "checkpoint" / "driver.pt", weights_only=False)["state"]
    assert state["data_pos"] == 80 and [r["step"] for r in state["rows"]] == [0, 1, 2, 3, 4]
    assert [r["attempt"] for r in read_rows(out / "metrics.csv", all_attempts=True)] == ["1"] * 2 + ["2"] * 2 + ["3"]

    monkeypatch.setattr(Trainer, "_run_stage", _fake_stage({0, 1, 2}))
    sets["output_dir"] = str(tmp_path / "run2")
    with pytest.raises(RuntimeError, match=r"after 2 restart\(s\) from the last checkpoint \(learner.max_restarts\)"):
        Trainer(prepare(ROOT / "configs" / "tiny.yaml", sets), progress=False).run()
    assert [r["step"] for r in read_rows(tmp_path / "run2" / "metrics.csv")] == ["0", "1"]


def _dying_learner_class(flag: str) -> type:
    from learner.engine import Learner

    class DyingLearner(Learner):
        """Kills its own process in the middle of its first RL update while ``flag`` exists (once)."""

        def train_rl(self, *args, **kwargs):
            if os.path.exists(flag):
                os.remove(flag)
                os._exit(1)
            return super().train_rl(*args, **kwargs)

    return DyingLearner


@pytest.mark.slow
def test_a_run_goes_on_through_env_faults_and_a_learner_death(ray_local, tmp_path, monkeypatch):
    """A plugin env registered the plain gymnasium way, SFT on its oracle, RL episodes that hang, raise at
    reset and at step, and the learner process killed mid-update: the run finishes; every step is logged once
    in the trajectory; failures are counted per step and recorded with their tracebacks."""
    from marathon.driver import Trainer, prepare

    die, once = tmp_path / "die", tmp_path / "once"
    die.touch()
    once.touch()
    sets = {
        "env.id": FAULTY, "env.kwargs": {"difficulty": "easy", "faults": {1: "hang", 2: "step"}, "once": str(once),
                                         "once_seed": 3},
        "steps": 3, "sft.steps": 1, "sft.num_demos": 8, "sft.batch_size": 8, "eval.num_seeds": 2, "eval.every": 0,
        "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.env_timeout_s": 2.0, "checkpoint_every": 1,
        "output_dir": str(tmp_path / "run"),
    }
    monkeypatch.setattr(Trainer, "learner_cls", _dying_learner_class(str(die)))
    summary = Trainer(prepare(ROOT / "configs" / "tiny.yaml", sets), progress=False).run()
    out = tmp_path / "run"
    assert summary["actor_restarts"] == 1 and summary["step"] == 4 and not die.exists() and not once.exists()
    rows = read_rows(out / "metrics.csv")
    assert [r["phase"] for r in rows] == ["sft", "rl", "rl", "rl"]
    # step 1: seeds 0 and 1 (all 4 hang); step 2: seeds 2 (all 4 raise in step) and 3 (one episode fails at reset
    # once: in whichever attempt of step 2 came first); step 3: seeds 4, 5
    assert rows[1]["infra_failures/timeout"] == "4" and rows[1]["infra_failures"] == "4"
    assert rows[2]["infra_failures/exception"] in ("4", "5") and rows[2]["infra_failures"] in ("4", "5")
    assert rows[3]["infra_failures"] == "0"
    assert int(rows[1]["trained_episodes"]) <= 4 and int(rows[2]["trained_episodes"]) <= 4  # one group each
    assert all(not math.isnan(float(r["reward_mean"])) for r in rows[1:])
    state = torch.load(out / "checkpoint" / "driver.pt", weights_only=False)["state"]
    assert state["finished"] and state["data_pos"] == 6 and [r["step"] for r in state["rows"]] == [0, 1, 2, 3]
    attempts = [(r["step"], r["attempt"]) for r in read_rows(out / "metrics.csv", all_attempts=True)]
    assert any(a == "2" for _, a in attempts)  # the step the learner died in was redone after the restart
    import json

    records = [json.loads(line) for line in (out / "infra_failures.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"timeout", "exception"} and all(r["traceback"] for r in records)
    assert sum(r["call"] == "reset" and "backing service" in r["message"] for r in records) == 1
    redone = min(int(s) for s, a in attempts if a == "2")  # the first step of the second attempt
    if redone in (1, 2):  # a step with failures was redone: they were recorded again, as attempt 2
        assert {r["attempt"] for r in records if r["step"] == redone} == {1, 2}
