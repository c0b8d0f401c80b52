"""The async RL loop (``rollout.mode: async``): rollout and learner overlap instead of taking turns.

The sync loop (``Trainer._rl_step``) rolls out one step's batch, waits for its slowest episode, trains, syncs the
weights, and only then starts the next batch. Here the rollout workers (``AsyncRolloutWorker``, vLLM's async
engine) never stop: the driver keeps up to ``prompts_per_step x (max_staleness + 1)`` task groups in flight,
waiting or in training, hands the learner the first ``prompts_per_step`` complete groups whenever it is idle, and while it
trains keeps collecting; when an update finishes, the new weights are loaded into the running engines between two
engine steps and the episodes in flight continue under them (partial rollouts).

Every token carries the policy version that sampled it and its behaviour logprob under that version
(``Trajectory.versions`` / ``logprobs``); the learner's importance weight pi_learner / pi_behaviour uses each
token's own behaviour logprob (decoupled PPO, ``learner/losses.py``; ``loss.is_level: segment`` truncates it
per run of equal version). A group is trained on only if its oldest token is at most ``max_staleness`` versions
behind the learner; older groups are re-run (``stale_episodes: rerun``: the stale episodes start again from
scratch under the current weights) or dropped (``drop``).

Per step, besides the sync loop's columns: ``staleness/mean``, ``staleness/max`` and the histogram
``staleness/0``, ``staleness/1``, ``staleness/2``, ``staleness/3+`` (fractions of the trained model tokens that
many versions behind), ``partial_frac`` (trained episodes whose tokens span a weight update), ``stale_dropped``
/ ``stale_rerun`` (episodes), ``time/wait`` (the learner idle, waiting for a batch), ``time/step`` (wall time of
the step) and ``inflight`` (episodes running when the step ended).

Resuming: a checkpoint holds the learner and the driver state as in sync mode; episodes in flight at the save are
not kept (a resumed run starts new tasks from the first one not yet handed out). Async runs are not
reproducible sample for sample: where a weight update lands in an episode depends on timing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Group:
    task: int  # task index (the data position of its seed)
    seed: int
    trajs: dict[int, Any] = field(default_factory=dict)  # member g -> Trajectory
    reruns: int = 0

    def complete(self, size: int) -> bool:
        return len(self.trajs) == size

    def oldest(self) -> int:
        return min(t.policy_version for t in self.trajs.values())


def staleness_stats(trajs: list[Any], learner_version: int) -> dict[str, float]:
    """Token staleness (learner version - the version that sampled the token) over the model tokens of
    ``trajs``: mean, max, histogram (fractions) and the fraction of partial episodes (several versions)."""
    ages = np.array([learner_version - v for t in trajs for v, m in zip(t.token_versions(), t.loss_mask) if m])
    if ages.size == 0:
        return {}
    out = {"staleness/mean": float(ages.mean()), "staleness/max": float(ages.max())}
    for k in range(3):
        out[f"staleness/{k}"] = float((ages == k).mean())
    out["staleness/3+"] = float((ages >= 3).mean())
    out["partial_frac"] = float(np.mean([t.num_versions > 1 for t in trajs]))
    return out


class AsyncSteps:
    """Runs a stage's RL steps in async mode on a ``Trainer`` whose rollout workers are ``AsyncRolloutWorker``s."""

    def __init__(self, trainer: Any, state: Any, stage: Any) -> None:
        self.tr, self.state, self.stage = trainer, state, stage
        self.cfg = trainer.cfg

    def _episode_id(self, group: _Group, g: int) -> str:
        return f"{self.stage.name}-t{group.task}-g{g}" + (f"-r{group.reruns}" if group.reruns else "")

    def _submit(self, stream: Any, group: _Group, members: list[int]) -> None:
        from marathon.driver import derive_seed
        from rollout.runner import EpisodeSpec

        specs = [EpisodeSpec(self._episode_id(group, g), self.cfg.env.id, group.seed, self.stage.env_kwargs,
                             derive_seed(self.cfg.seed, group.task, g)) for g in members]
        for spec, g in zip(specs, members):
            self._member[spec.episode_id] = (group.task, g)
        stream.submit(specs)

    def run(self) -> None:
        import ray

        from envs import train_seeds
        from rollout.async_worker import EpisodeStream
        from rollout.runner import RolloutConfig

        tr, cfg, state, stage = self.tr, self.cfg, self.state, self.stage
        P, G, k = stage.prompts_per_step, stage.group_size, cfg.rollout.max_staleness
        rollout = RolloutConfig(max_new_tokens=stage.max_new_tokens_per_turn, max_context=stage.max_episode_tokens,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                env_timeout_s=cfg.rollout.env_timeout_s)
        stream = EpisodeStream(tr.pool, rollout)
        self._member: dict[str, tuple[int, int]] = {}  # episode id -> (task, member)
        groups: dict[int, _Group] = {}  # submitted, not yet trained on or dropped
        ready: list[int] = []  # complete groups, in completion order
        next_task = state.data_pos
        capacity = P * (k + 1)
        train: dict[str, Any] | None = None
        step_start = idle_since = time.perf_counter()
        wait_s, dropped, rerun, gen_tokens = 0.0, 0, 0, 0
        try:
            while state.stage_step < stage.steps:
                # top up: new tasks while few enough are outstanding (the batch in training counts: its update is
                # the one that ages everything generated meanwhile)
                while len(groups) + (P if train is not None else 0) < capacity:
                    seed = train_seeds(1, start=cfg.seed * 10_000_000 + next_task)[0]
                    groups[next_task] = _Group(next_task, seed)
                    self._submit(stream, groups[next_task], list(range(G)))
                    next_task += 1
                for t in stream.poll(timeout_s=0.05 if train is not None else 0.5):
                    task, g = self._member.pop(t.episode_id)
                    groups[task].trajs[g] = t
                    gen_tokens += t.num_model_tokens
                    if groups[task].complete(G):
                        ready.append(task)
                if train is None:  # the learner is idle: a batch of P fresh complete groups?
                    fresh = []
                    for task in list(ready):
                        grp = groups[task]
                        if state.version - grp.oldest() <= k:
                            fresh.append(task)
                            continue
                        ready.remove(task)
                        stale = [g for g, t in grp.trajs.items() if state.version - t.policy_version > k]
                        if cfg.rollout.stale_episodes == "drop":
                            del groups[task]
                            dropped += G
                        else:  # re-run the stale members from scratch under the current weights
                            grp.reruns += 1
                            for g in stale:
                                del grp.trajs[g]
                            self._submit(stream, grp, stale)
                            rerun += len(stale)
                    if len(fresh) >= P:
                        batch = fresh[:P]
                        for task in batch:
                            ready.remove(task)
                        wait_s += time.perf_counter() - idle_since
                        train = self._start_update([groups.pop(task) for task in batch])
                if train is not None and (train["ref"] is None or ray.wait([train["ref"]], timeout=0)[0]):
                    stats = ray.get(train["ref"]) if train["ref"] is not None else {}
                    t_update = time.perf_counter() - train["t0"]
                    t_sync = 0.0
                    if train["ref"] is not None:
                        state.version += 1
                        t0 = time.perf_counter()
                        tr._sync(state)  # loaded between engine steps; episodes in flight continue
                        t_sync = time.perf_counter() - t0
                    state.data_pos = next_task
                    state.stage_step += 1
                    now = time.perf_counter()
                    row = {**train["row"], **stats, "version": state.version,
                           "time/update": t_update, "time/sync": t_sync, "time/wait": wait_s,
                           "time/step": now - step_start, "gen_tokens_per_s": gen_tokens / max(now - step_start, 1e-9),
                           "stale_dropped": dropped, "stale_rerun": rerun, "inflight": stream.outstanding}
                    row.update(ray.get(tr.learner.router_stats.remote()))
                    tr._record_failures(state, train["failures"])
                    tr._row(state, row)
                    self._check_failed_steps(train)
                    step_start = idle_since = now
                    wait_s, dropped, rerun, gen_tokens = 0.0, 0, 0, 0
                    train = None
                    tr._between_steps(state, stage)
                    idle_since = time.perf_counter()
        finally:
            stream.close()  # episodes still running are dropped: the stage's evaluation runs on quiet engines

    def _start_update(self, groups: list[_Group]) -> dict[str, Any]:
        """Rewards, advantages and the learner call for one batch of complete groups (returns at once)."""
        from learner.packing import Sample
        from marathon.driver import _failure, _mean, episode_advantages, score_episodes

        tr, cfg, state = self.tr, self.cfg, self.state
        G = self.stage.group_size
        trajs = [grp.trajs[g] for grp in groups for g in range(G)]
        rewards = score_episodes(trajs, tr.plan.reward)
        adv = episode_advantages(rewards, G, cfg.learner.loss)
        samples = [Sample(t.token_ids, t.loss_mask, t.logprobs, float(a), t.routed_experts, versions=t.versions)
                   for t, a in zip(trajs, adv) if a]
        ok = [t for t, r in zip(trajs, rewards) if r is not None]
        failures = [(t, _failure(t)) for t, r in zip(trajs, rewards) if r is None]
        row = {
            "phase": "rl", "stage": self.stage.name,
            "reward_mean": _mean([t.reward for t in ok]), "success_rate": _mean([t.success for t in ok]),
            "episode_tokens": _mean([len(t.token_ids) for t in ok]),
            "model_tokens": _mean([t.num_model_tokens for t in ok]),
            "turns": _mean([t.num_turns for t in ok]),
            "truncated": _mean([t.truncated for t in ok]),
            "trained_episodes": len(samples), "infra_failures": len(failures),
            **{f"infra_failures/{k}": n for k, n in Counter(f["kind"] for _, f in failures).items()},
            **{f"reward/{k}": _mean([t.reward_terms[k] for t in ok]) for k in tr.plan.reward.terms},
            **staleness_stats(trajs, state.version),
        }
        ref = (tr.learner.train_rl.remote(samples, cfg.learner.optimizer.lr, cfg.rollout.temperature)
               if samples else None)
        return {"ref": ref, "t0": time.perf_counter(), "row": row, "failures": failures, "ok": bool(ok)}

    def _check_failed_steps(self, train: dict[str, Any]) -> None:
        tr = self.tr
        tr.failed_steps = 0 if train["ok"] else tr.failed_steps + 1
        if tr.failed_steps >= self.cfg.rollout.max_failed_steps:
            (kind, msg), n = Counter((f["kind"], f["message"]) for _, f in train["failures"]).most_common(1)[0]
            raise RuntimeError(f"every episode of the last {tr.failed_steps} RL steps was an infra failure "
                               f"(rollout.max_failed_steps); the commonest, {n} of the last step's: {kind}: {msg}")
