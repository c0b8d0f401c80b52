"""Async rollouts: per-token policy versions and behaviour logprobs through to the learner's ratio; weights that
change mid-episode on vLLM's async engine; a rollout worker killed mid-stream (no episode lost, none counted
twice); the heavy-tailed benchmark env; the async RL loop end to end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import envs
from configs.schema import LossSection
from learner.losses import policy_loss
from learner.packing import Sample, collate
from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig, WorkerPool
from rollout.types import Trajectory

ROOT = Path(__file__).resolve().parent.parent
GATED = "marathon-test/Gated-v0"
# Async workers make their envs in their own process: the "module:id" form makes gymnasium import this module
# (which registers the env) there first; Ray workers start in the driver's working directory (the repo root).
GATED_REMOTE = f"tests.test_async_rollout:{GATED}"


class GatedEnv(gym.Env):
    """``turns`` turns of fixed tool messages. With ``gate``, the step of turn ``gate_turn`` writes
    ``gate + ".armed"`` and waits (up to 120 s) for ``gate + ".go"``: the test changes the weights meanwhile.
    With ``die_flag``, the step of turn ``die_turn`` creates that file (once per test) to make a faulty worker
    kill itself in its next engine call."""

    def __init__(self, turns: int = 3, gate: str | None = None, gate_turn: int = 2, die_flag: str | None = None,
                 die_turn: int = 1):
        self.turns, self.gate, self.gate_turn, self.die_flag, self.die_turn = turns, gate, gate_turn, die_flag, die_turn

    def reset(self, *, seed=None, options=None):
        self.t, self.seed = 0, seed
        msgs = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"task {seed}"}]
        return {"messages": msgs, "tools": []}, {}

    def step(self, action):
        self.t += 1
        if self.gate and self.t == self.gate_turn:
            Path(self.gate + ".armed").touch()
            deadline = time.time() + 120
            while not Path(self.gate + ".go").exists() and time.time() < deadline:
                time.sleep(0.05)
        if self.die_flag and self.t == self.die_turn and not Path(self.die_flag + ".fired").exists():
            Path(self.die_flag + ".fired").touch()
            Path(self.die_flag).touch()
        if self.t == self.turns:
            return {"messages": []}, 0.0, True, False, {"success": True, "turns": self.t}
        return {"messages": [{"role": "tool", "content": f"result {self.t} of task {self.seed}"}]}, 0.0, False, False, {}


envs.register(GATED, GatedEnv)


# -- learner side: no engine ----------------------------------------------------------------------------------
def _cfg(**kw):
    return LossSection(**{**dict(clip_low=0.2, clip_high=0.2, tis_cap=None, ratio_mask=None, kl_coef=0.0), **kw})


def test_segment_ids_follow_version_runs():
    # prompt (2) | turn v0 (3) | obs (2) | turn v0 then v1 (2 + 2) | obs (1) | turn v2 (2)
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1]
    vers = [-1, -1, 0, 0, 0, -1, -1, 0, 0, 1, 1, -1, 2, 2]
    a = Sample(list(range(14)), mask, [-0.5 if m else 0.0 for m in mask], 1.0, versions=vers)
    b = Sample(list(range(5)), [0, 0, 1, 1, 1], [0, 0, -1.0, -1.0, -1.0], -1.0)  # no versions: one run
    mb = collate([a, b], [0, 1], packed=True)
    seg = mb.segment_ids[0].tolist()
    # position t predicts token t + 1: runs of a are {v0: targets 2-4, 7-8}, {v1: 9-10}, {v2: 12-13}
    assert seg[:14] == [-1, 0, 0, 0, -1, -1, 0, 0, 1, 1, -1, 2, 2, -1]
    assert seg[14:] == [-1, 3, 3, 3, -1]
    assert ((mb.segment_ids >= 0) == (mb.loss_mask > 0)).all()


def test_ratio_uses_each_tokens_own_behaviour_logprob():
    """Tokens sampled by different versions: the importance weight of each is pi_learner / its own behaviour
    probability (per token), or the geometric mean over its run of equal version (per segment)."""
    logp = torch.tensor([-1.0, -1.2, -0.7, -0.9, -2.0], requires_grad=True)  # learner (pi = pi_old, one update)
    behav = torch.tensor([-1.5, -1.0, -0.7, -0.8, -2.4])  # tokens 0-1 by version 3, 2-4 by version 4
    seg = torch.tensor([0, 0, 1, 1, 1])
    adv, mask = torch.ones(5), torch.ones(5)
    out = policy_loss(logp, logp.detach(), behav, adv, mask, _cfg(tis_cap=10.0))
    out.loss_sum.backward()
    w = torch.exp(logp.detach() - behav)
    assert logp.grad.tolist() == pytest.approx((-w).tolist(), rel=1e-6)  # d/dlogp of -ratio * A * w, ratio = 1
    assert out.stats["is_weight"] == pytest.approx(float(w.sum()), rel=1e-6)

    logp.grad = None
    out = policy_loss(logp, logp.detach(), behav, adv, mask, _cfg(is_level="segment", tis_cap=10.0), segments=seg)
    out.loss_sum.backward()
    d = logp.detach() - behav
    seg_w = torch.cat([d[:2].mean().exp().expand(2), d[2:].mean().exp().expand(3)])
    assert logp.grad.tolist() == pytest.approx((-seg_w).tolist(), rel=1e-6)
    # capped per segment; the ratio mask drops a whole segment
    out = policy_loss(logp, logp.detach(), behav, adv, mask, _cfg(is_level="segment", tis_cap=1.12,
                                                                  ratio_mask=(0.9, 1.15)), segments=seg)
    assert float(d[:2].mean().exp()) > 1.15 > float(d[2:].mean().exp()) > 1.1
    assert out.stats["masked"] == 2.0 and out.stats["is_weight"] == pytest.approx(2 * 1.12 + 3 * float(d[2:].mean().exp()))


def test_runner_records_per_token_versions():
    """A turn whose tokens came from two versions (weights changed mid-turn) keeps both in the trajectory."""
    from rollout.worker import GenResult

    class Codec:
        stop_token_ids = (1,)

        def prompt_ids(self, messages, tools=None):
            return [7, 7, 7]

        def turn_text(self, ids):
            return "x"

        def observation_ids(self, turn, messages, tools=None):
            return [9, 9]

    class Pool:
        version = 0
        workers = []

    runner = EpisodeRunner(Pool(), Codec(), RolloutConfig(max_new_tokens=8, max_context=64))
    ep = runner._start(EpisodeSpec("e", GATED, 0, {"turns": 2}), 1)
    assert runner._advance(ep, GenResult("e/1/0", [5, 6, 1], [-1.0, -2.0, -3.0], "stop", 3, token_versions=[3, 3, 4]))
    assert not runner._advance(ep, GenResult("e/1/1", [5, 1], [-1.0, -1.0], "stop", 4, token_versions=[4, 4]))
    t = runner._trajectory(ep, 0)
    assert t.versions == [-1, -1, -1, 3, 3, 4, -1, -1, 4, 4] and t.policy_version == 3 and t.num_versions == 2
    assert t.logprobs[3:6] == [-1.0, -2.0, -3.0]


def test_heavy_tailed_env_turns_and_lengths_span_10x():
    env = envs.make("marathon/HeavyTail-v0")
    shapes = [env.reset(seed=s)[1] for s in range(300)]
    turns = [i["num_questions"] for i in shapes]
    digits = [d for i in shapes for d in i["answer_digits"]]
    assert max(turns) >= 10 * min(turns) and max(digits) >= 10 * min(digits)
    assert sorted(turns)[len(turns) // 2] <= 3  # heavy tail: the median session is short
    obs, info = env.reset(seed=5)
    for _ in range(info["num_questions"]):
        assert info["max_new_tokens"] == len(env.unwrapped.oracle_action()) + 4
        obs, _, done, _, info = env.step(env.unwrapped.oracle_action())
    assert done and info["success"] and info["score"] == 1.0


# -- vLLM's async engine ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_worker(ray_local, tiny_qwen3_dir):
    from rollout.async_worker import AsyncRolloutWorker
    from rollout.worker import WorkerConfig, spawn_worker

    worker = spawn_worker(WorkerConfig(model=str(tiny_qwen3_dir), dtype="float32", max_model_len=1024),
                          cls=AsyncRolloutWorker, max_restarts=0)
    ray_local.get(worker.ready.remote())
    yield worker
    ray_local.kill(worker)


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # position i predicts id i + 1


@pytest.mark.vllm
def test_weights_change_mid_episode(ray_local, async_worker, tiny_qwen3_dir, tmp_path):
    """An episode whose weights change between its turns, and a long turn whose weights change inside it: the
    tokens after the change carry the new version, every token's logprob is its behaviour logprob under its
    own version (the HF model with those weights, on the same ids), and the learner's ratio uses them."""
    from transformers import AutoModelForCausalLM

    from rollout.worker import GenRequest

    old = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    gate = str(tmp_path / "gate")
    rollout = RolloutConfig(max_new_tokens=12, max_context=1024)
    spec = EpisodeSpec("gated", GATED_REMOTE, 7, {"turns": 4, "gate": gate, "gate_turn": 2})
    ray_local.get(async_worker.start.remote([(spec, 1)], rollout))
    deadline = time.time() + 300
    while not Path(gate + ".armed").exists():
        assert time.time() < deadline and not ray_local.get(async_worker.take.remote(0.0)), "the episode never got to its gate"
        time.sleep(0.05)
    # the update must land inside the long turn on any machine: time one such turn first, ship the weights to
    # the object store before it starts, and send the update a third of the way in
    weights = ray_local.put(new.state_dict())
    start = time.perf_counter()
    ray_local.get(async_worker.generate_one.remote(GenRequest("calibrate", list(range(3, 40)), 900, ignore_eos=True)))
    turn_s = time.perf_counter() - start
    long_turn = async_worker.generate_one.remote(GenRequest("long", list(range(3, 40)), 900, ignore_eos=True))
    time.sleep(turn_s / 3)
    try:
        ray_local.get(async_worker.update_weights.remote(weights, 1))
        Path(gate + ".go").touch()
        (t,) = ray_local.get(async_worker.take.remote(60.0))
        res = ray_local.get(long_turn)
    finally:  # the originals back for the other tests, through the streamed path (learner/weight_sync.py)
        from learner.weight_sync import stream_to_workers

        stream_to_workers(old, [async_worker], 0, dtype="float32")
    after = ray_local.get(async_worker.generate_one.remote(GenRequest("after", list(range(3, 20)), 16, ignore_eos=True)))
    assert after.token_versions == [0] * 16
    ref = _hf_logprobs(old, list(range(3, 20)) + after.token_ids)[16:]
    assert (torch.tensor(after.logprobs) - ref).abs().max() < 1e-4

    # the episode: turns 1-2 sampled by version 0, turns 3-4 by version 1 (the update came in its env step)
    assert t.episode_id == "gated" and t.num_turns == 4 and t.policy_version == 0
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
    vers = torch.tensor(t.versions[1:])[mask]
    turn_of = torch.cumsum(torch.tensor([0] + [int(a == 0 and b == 1) for a, b in zip(t.loss_mask, t.loss_mask[1:])]), 0)
    assert set(vers.tolist()) == {0, 1} and (vers[1:] >= vers[:-1]).all()
    assert (vers == (turn_of[1:][mask] > 2).long()).all()  # the version follows the turn
    behav = torch.tensor(t.logprobs[1:])[mask]
    ref = torch.where(vers == 1, _hf_logprobs(new, t.token_ids)[mask], _hf_logprobs(old, t.token_ids)[mask])
    assert (behav - ref).abs().max() < 1e-4

    # the long turn: the update landed inside it; tokens after it were sampled by version 1 given the same
    # context (the engine recomputed the running request's cache under the new weights)
    ids = list(range(3, 40)) + res.token_ids
    v = torch.tensor(res.token_versions)
    assert v[0] == 0 and v[-1] == 1 and (v[1:] >= v[:-1]).all(), \
        f"first/last token versions {int(v[0])}/{int(v[-1])}; a {len(v)}-token turn took {turn_s:.2f} s here"
    n = len(range(3, 40))
    ref = torch.where(v == 1, _hf_logprobs(new, ids)[n - 1:], _hf_logprobs(old, ids)[n - 1:])
    assert (torch.tensor(res.logprobs) - ref).abs().max() < 1e-4

    # the learner's ratio: pi_learner (the new weights) over each token's own behaviour probability
    sample = Sample(t.token_ids, t.loss_mask, t.logprobs, 1.0, versions=t.versions)
    mb = collate([sample], [0], packed=True)
    learner = _hf_logprobs(new, t.token_ids)
    logp = torch.cat([learner, torch.zeros(1)])[None]
    out = policy_loss(logp, logp, mb.rollout_logprobs, mb.advantages, mb.loss_mask, _cfg(tis_cap=100.0))
    w = torch.exp(learner[mask] - behav)
    assert out.stats["is_weight"] == pytest.approx(float(w.sum()), rel=1e-5)
    assert torch.allclose(w[vers == 1], torch.ones(int((vers == 1).sum())), atol=1e-3)  # on-policy tokens
    assert (w[vers == 0] - 1).abs().max() > 1e-2  # the stale tokens are reweighted


@pytest.mark.vllm
def test_continuous_episodes_and_the_lock_step_api(ray_local, async_worker, tiny_qwen3_dir):
    """Episodes of different lengths run as coroutines (a 1-turn one is back before an 6-turn one);
    the same worker serves EpisodeRunner's lock-step calls, and later turns hit the prefix cache."""
    from transformers import AutoTokenizer

    from rollout.chat import ChatCodec

    rollout = RolloutConfig(max_new_tokens=8, max_context=1024)
    before = ray_local.get(async_worker.stats.remote())
    specs = [EpisodeSpec("long", GATED_REMOTE, 1, {"turns": 6}), EpisodeSpec("short", GATED_REMOTE, 2, {"turns": 1})]
    trajs = ray_local.get(async_worker.run.remote(specs, rollout))
    assert [t.num_turns for t in trajs] == [6, 1] and all(t.versions[-1] >= 0 for t in trajs)
    after = ray_local.get(async_worker.stats.remote())
    assert after["cached_tokens"] > before["cached_tokens"]  # turns 2..6 reuse the earlier turns' cache
    codec = ChatCodec(AutoTokenizer.from_pretrained(tiny_qwen3_dir))
    trajs = EpisodeRunner(WorkerPool([async_worker]), codec, rollout).run(specs)
    assert [t.num_turns for t in trajs] == [6, 1] and all(t.success for t in trajs)


def _faulty_async_worker(flag: str) -> type:
    from rollout.async_worker import AsyncRolloutWorker

    class FaultyAsyncWorker(AsyncRolloutWorker):
        """Kills its own process in an engine call while ``flag`` exists (once: the file goes)."""

        async def generate_one(self, r):
            if os.path.exists(flag):
                os.remove(flag)
                os._exit(1)
            return await super().generate_one(r)

    return FaultyAsyncWorker


@pytest.mark.vllm
def test_killed_worker_loses_no_episode_and_counts_none_twice(ray_local, async_worker, tiny_qwen3_dir, tmp_path):
    """Two async workers stream episodes; one dies mid-stream (its process exits in an engine call while
    episodes are running on it). Ray restarts it, it gets the pool's weights again, its episodes re-run from
    scratch; every episode id comes back exactly once, and a late result of a superseded attempt is ignored."""
    import ray

    from rollout.async_worker import EpisodeStream
    from rollout.worker import WorkerConfig, spawn_worker

    flag = str(tmp_path / "die")
    cfg = WorkerConfig(model=str(tiny_qwen3_dir), dtype="float32", max_model_len=1024)
    faulty = spawn_worker(cfg, cls=_faulty_async_worker(flag), max_restarts=1)
    try:
        pid = ray_local.get(faulty.ready.remote())["pid"]
        pool = WorkerPool([async_worker, faulty])
        stream = EpisodeStream(pool, RolloutConfig(max_new_tokens=8, max_context=1024), take_wait_s=0.2)
        specs = [EpisodeSpec(f"ep{i}", GATED_REMOTE, 100 + i, {"turns": 3, "die_flag": flag, "die_turn": 2})
                 for i in range(8)]
        stream.submit(specs)
        on_faulty = {eid for eid, (_, _, w) in stream.running.items() if w == 1}
        assert len(on_faulty) == 4
        got = []
        deadline = time.time() + 600
        while stream.outstanding and time.time() < deadline:
            got += stream.poll(1.0)
        assert ray_local.get(faulty.ready.remote())["pid"] != pid  # Ray restarted it
        ids = [t.episode_id for t in got]
        assert sorted(ids) == sorted(s.episode_id for s in specs)  # none lost, none twice
        assert stream.stats.worker_failures == 1 and stream.stats.returned == 8
        rerun = {t.episode_id for t in got if t.info["attempts"] == 2}
        assert rerun and rerun <= on_faulty and stream.stats.episode_reruns >= len(rerun)
        assert all(t.num_turns == 3 and t.success for t in got)
        # a result of a superseded attempt (e.g. it finished just before the worker died) is not counted again
        late = got[0]
        stream.running[late.episode_id] = (specs[0], 2, 0)
        ray_local.get(async_worker.start.remote([(EpisodeSpec(late.episode_id, GATED_REMOTE, 1, {"turns": 1}), 1)],
                                                stream.rollout))
        seen = []
        deadline = time.time() + 60
        while not seen and time.time() < deadline:
            seen = ray.get(async_worker.take.remote(1.0))
        stream.running.pop(late.episode_id)
        assert [t.info["attempts"] for t in seen] == [1]  # attempt 1 arrives while attempt 2 is current
    finally:
        ray_local.kill(faulty)


@pytest.mark.vllm
def test_async_training_run_end_to_end(ray_local, tmp_path):
    """``rollout.mode: async`` through ``marathon train``'s driver: steps logged with staleness metrics, the
    weights synced while episodes run, evaluations and the final policy as in sync mode."""
    import csv

    from marathon.driver import Trainer, prepare

    small = {"steps": 3, "sft.steps": 0, "eval.num_seeds": 4, "eval.every": 0, "rollout.prompts_per_step": 2,
             "rollout.group_size": 4, "checkpoint_every": 2, "rollout.mode": "async", "rollout.max_staleness": 1,
             "learner.loss.is_level": "segment", "model.source": "tiny-qwen3", "output_dir": str(tmp_path / "run")}
    summary = Trainer(prepare(ROOT / "configs" / "tiny.yaml", small), progress=False).run()
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "rl"]
    assert len(rows) == 3 and summary["step"] == 3
    for r in rows:
        assert float(r["staleness/max"]) <= 1 and 0 <= float(r["partial_frac"]) <= 1 and r["time/wait"] != ""
    assert int(rows[-1]["version"]) >= 1
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_cli_sets_its_own_cpu_defaults():
    """A command typed as the README shows (no Makefile exports) gets vLLM's CPU KV-cache size etc.; values the
    caller set are kept."""
    from marathon.cli import set_runtime_defaults

    env = {"TOKENIZERS_PARALLELISM": "true"}
    set_runtime_defaults(env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "true"
    assert env.get("DS_ACCELERATOR", "cpu") == "cpu"
