"""Concurrent multi-round episodes on a pool of rollout workers.

Each worker owns a share of the episodes. Whenever a worker is free, ALL pending turns of its live episodes go to
it in one ``generate`` call (vLLM batches them); when the call returns, the envs step (in threads) and the
episodes that continue are queued for that worker's next call. Workers run independently: no global barrier.

Failures: a worker whose process dies mid-call (Ray restarts it, ``max_restarts``) gets its live episodes back,
each re-run from scratch (fresh env, same seed); a worker that stays dead hands them to the others. Episodes are
keyed by id: each returns exactly once, ``info["attempts"]`` says how many runs it took. Env faults are data:
every env call goes through ``envs.guard.GuardedEnv`` (time limit ``env_timeout_s``), so an env that raises,
hangs or returns malformed values in ``make``/``reset``/``step`` ends just that episode, with
``info["infra_failure"]`` (also set when the env reports one itself, e.g. a dataset env's verifier) and
``info["finish"] == "infra_failure"``; a prompt longer than ``max_context`` is one too (kind ``context``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from envs.guard import GuardedEnv, failure_info
from rollout.chat import ChatCodec, TokenEpisode
from rollout.types import Trajectory
from rollout.worker import GenRequest, GenResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    max_new_tokens: int = 256  # per model turn
    max_context: int = 4096  # per episode: prompt + turns + observations (<= the workers' max_model_len)
    temperature: float = 1.0
    top_p: float = 1.0
    max_attempts: int = 3  # runs of one episode (first + re-runs after worker failures)
    env_threads: int = 8  # envs stepped concurrently after each engine call
    recover_timeout_s: float = 900.0  # wait for Ray to restart a dead worker
    env_timeout_s: float | None = 60.0  # per env reset/step call (envs.guard); None: no limit


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    env_id: str
    seed: int  # the task (env.reset seed)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_seed: int | None = None  # set: turn t samples with seed (sampling_seed, t); a re-run replays it


@dataclass
class RunStats:
    engine_calls: int = 0
    turns: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    worker_failures: int = 0
    episode_reruns: int = 0
    infra_failures: int = 0  # episodes ended by an env fault (info["infra_failure"])


class WorkerPool:
    """Rollout worker actors and the policy version they must serve (re-sent to a worker Ray restarted)."""

    def __init__(self, workers: Sequence[Any], version: int = 0) -> None:
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = list(workers)
        self.version = version
        self._weights_ref = None  # the latest weights in Ray's object store, for workers that restart
        # or, with streamed weight sync (learner/weight_sync.py), how to send them again: resend(worker, version)
        self.resend = None

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> list[float]:
        """Send new weights (HF names) to every worker through one object-store copy; seconds per worker."""
        import ray

        named = [(k, v.detach().contiguous()) for k, v in (weights.items() if isinstance(weights, Mapping) else weights)]
        ref = ray.put(named)
        seconds = ray.get([w.update_weights.remote(ref, version) for w in self.workers])
        self._weights_ref, self.version = ref, version
        return seconds

    def recover(self, index: int, timeout_s: float) -> bool:
        """After a failed call: True once worker ``index`` is back (restarted and serving ``self.version``),
        False if Ray gave up on it."""
        import ray

        worker = self.workers[index]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                state = ray.get(worker.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorUnavailableError:  # restarting: Ray refuses calls until it is back
                if time.monotonic() > deadline:
                    log.warning("rollout worker %d did not come back within %.0f s", index, timeout_s)
                    return False
                time.sleep(0.5)
            except (ray.exceptions.ActorDiedError, ray.exceptions.GetTimeoutError) as e:
                log.warning("rollout worker %d is gone: %s", index, e)
                return False
        if state["version"] != self.version:
            if self._weights_ref is None and self.resend is not None:
                self.resend(worker, self.version)
                return True
            if self._weights_ref is None:
                raise RuntimeError(f"worker {index} serves version {state['version']}, the pool expects "
                                   f"{self.version}, and holds no weights to re-send")
            ray.get(worker.update_weights.remote(self._weights_ref, self.version))
        return True


@dataclass
class _Episode:
    spec: EpisodeSpec
    attempt: int
    env: GuardedEnv | None = None
    tools: list[dict] | None = None
    tokens: TokenEpisode | None = None
    turns: int = 0
    versions: set[int] = field(default_factory=set)
    info: dict[str, Any] = field(default_factory=dict)
    experts: list | None = None  # routing of the tokens run so far, [n][num_moe_layers][top_k], when returned
    token_versions: list[int] = field(default_factory=list)  # per token after the prompt: sampling version or -1
    turn_budget: int | None = None  # the env's token budget for the next turn (optional info["max_new_tokens"])
    truncated: bool = False
    finish: str = ""


class EpisodeRunner:
    """Drives episodes on a ``WorkerPool``; returns one ``Trajectory`` per ``EpisodeSpec`` (rewards unset)."""

    def __init__(self, pool: WorkerPool, codec: ChatCodec, config: RolloutConfig) -> None:
        self.pool = pool
        self.codec = codec
        self.config = config
        self.stats = RunStats()

    # -- one episode ------------------------------------------------------------------------------------------
    def _start(self, spec: EpisodeSpec, attempt: int) -> _Episode:
        """A fresh env, reset; ``ep.finish == "infra_failure"`` if that failed (the episode is then over)."""
        ep = _Episode(spec, attempt, env=GuardedEnv.make(spec.env_id, spec.env_kwargs, self.config.env_timeout_s,
                                                         label=f"{spec.env_id} episode {spec.episode_id}"))
        obs, info = ep.env.reset(seed=spec.seed)
        ep.tools = obs.get("tools")
        ep.tokens = TokenEpisode.start([])
        if "infra_failure" in info:
            ep.info, ep.finish = info, "infra_failure"
            return ep
        ids = self.codec.prompt_ids(obs["messages"], ep.tools)
        if len(ids) >= self.config.max_context:
            msg = (f"episode {spec.episode_id} (seed {spec.seed}): the prompt ({len(ids)} tokens) does not fit "
                   f"max_context={self.config.max_context}")
            ep.info, ep.finish = {"success": False, "infra_failure": failure_info("context", "reset", msg)}, "infra_failure"
            return ep
        ep.tokens = TokenEpisode.start(ids)
        ep.turn_budget = info.get("max_new_tokens")
        return ep

    @staticmethod
    def _request_id(ep: _Episode) -> str:
        return f"{ep.spec.episode_id}/{ep.attempt}/{ep.turns}"

    def _request(self, ep: _Episode) -> GenRequest:
        room = self.config.max_context - len(ep.tokens)
        seed = None if ep.spec.sampling_seed is None else (ep.spec.sampling_seed * 1_000_003 + ep.turns) % 2**31
        return GenRequest(
            request_id=self._request_id(ep),
            prompt_ids=list(ep.tokens.token_ids),
            max_new_tokens=min(self.config.max_new_tokens, room, ep.turn_budget or room),
            stop_token_ids=self.codec.stop_token_ids,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            seed=seed,
            routed_experts_from=len(ep.experts or ()),
        )

    def _advance(self, ep: _Episode, result: GenResult) -> bool:
        """Apply a model turn and step the env; True if the episode continues."""
        if result.request_id != self._request_id(ep):
            raise RuntimeError(f"result {result.request_id} does not belong to turn {self._request_id(ep)}")
        ep.tokens.add_model_turn(result.token_ids, result.logprobs)
        turn_versions = result.token_versions or [result.policy_version] * len(result.token_ids)
        ep.token_versions += turn_versions
        if result.routed_experts is not None:
            ep.experts = (ep.experts or []) + result.routed_experts
            if len(ep.experts) != len(ep.tokens) - 1:  # every id but the newest went through the model
                raise RuntimeError(f"episode {ep.spec.episode_id}: routing for {len(ep.experts)} tokens, expected "
                                   f"{len(ep.tokens) - 1}")
        ep.turns += 1
        ep.versions.update(turn_versions or [result.policy_version])
        if result.finish_reason == "context":  # cut off by the episode's context: the turn is incomplete
            ep.truncated, ep.finish = True, "context"
            return False
        obs, _, terminated, truncated, info = ep.env.step(self.codec.turn_text(result.token_ids))
        ep.info = info
        if "infra_failure" in info:
            ep.finish = "infra_failure"
            return False
        if terminated or truncated:
            ep.truncated, ep.finish = truncated, "truncated" if truncated else "terminated"
            return False
        delta = self.codec.observation_ids(result.token_ids, obs["messages"], ep.tools)
        if len(ep.tokens) + len(delta) >= self.config.max_context:  # no room left for another turn
            ep.truncated, ep.finish = True, "context"
            return False
        ep.tokens.add_observation(delta)
        ep.token_versions += [-1] * len(delta)
        ep.turn_budget = info.get("max_new_tokens")
        return True

    def _trajectory(self, ep: _Episode, worker: int) -> Trajectory:
        ep.env.close()
        t = ep.tokens
        return Trajectory(
            episode_id=ep.spec.episode_id,
            env_id=ep.spec.env_id,
            seed=ep.spec.seed,
            token_ids=t.token_ids,
            loss_mask=t.loss_mask,
            logprobs=t.logprobs,
            prompt_len=t.prompt_len,
            num_turns=ep.turns,
            success=bool(ep.info.get("success", False)),
            truncated=ep.truncated,
            info={"env": ep.info, "attempts": ep.attempt, "finish": ep.finish, "worker": worker,
                  "infra_failure": ep.info.get("infra_failure")},
            # the last id never ran through the model: its routing row (used by no loss term) repeats the previous
            routed_experts=None if ep.experts is None else ep.experts + ep.experts[-1:],
            policy_version=min(ep.versions, default=self.pool.version),
            versions=[-1] * t.prompt_len + ep.token_versions,
        )

    # -- the pool loop ----------------------------------------------------------------------------------------
    def run(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        import ray

        ids = [s.episode_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("episode ids must be unique")
        n = len(self.pool.workers)
        alive = [True] * n
        pending: list[list[_Episode]] = [[] for _ in range(n)]
        inflight: dict[Any, tuple[int, list[_Episode]]] = {}
        done: dict[str, Trajectory] = {}
        for i, spec in enumerate(specs):
            self._queue(self._start(spec, attempt=1), i % n, pending[i % n], done)

        def submit(w: int) -> None:
            batch, pending[w] = pending[w], []
            ref = self.pool.workers[w].generate.remote([self._request(ep) for ep in batch])
            inflight[ref] = (w, batch)
            self.stats.engine_calls += 1
            self.stats.batch_sizes.append(len(batch))

        with ThreadPoolExecutor(max_workers=self.config.env_threads) as threads:
            for w in range(n):
                if pending[w]:
                    submit(w)
            while inflight:
                (ref,), _ = ray.wait(list(inflight), num_returns=1)
                w, batch = inflight.pop(ref)
                try:
                    results = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._rerun(w, batch, e, alive, pending, done)
                else:
                    if len(results) != len(batch):
                        raise RuntimeError(f"worker {w} returned {len(results)} results for {len(batch)} requests")
                    going = list(threads.map(self._advance, batch, results))
                    self.stats.turns += len(batch)
                    for ep, cont in zip(batch, going):
                        if cont:
                            pending[w].append(ep)
                        else:
                            done[ep.spec.episode_id] = self._trajectory(ep, w)
                    self.stats.infra_failures += sum(ep.finish == "infra_failure" for ep in batch)
                busy = {v for v, _ in inflight.values()}
                for v in range(n):
                    if alive[v] and pending[v] and v not in busy:
                        submit(v)
        assert len(done) == len(specs), "an episode was lost"
        return [done[i] for i in ids]

    def _queue(self, ep: _Episode, w: int, queue: list[_Episode], done: dict[str, Trajectory]) -> None:
        """A just-started episode for worker ``w``: onto ``queue``, or straight to ``done`` if its env failed."""
        if ep.finish == "infra_failure":
            done[ep.spec.episode_id] = self._trajectory(ep, w)
            self.stats.infra_failures += 1
        else:
            queue.append(ep)

    def _rerun(self, w: int, batch: list[_Episode], error: Exception, alive: list[bool], pending: list[list[_Episode]],
               done: dict[str, Trajectory]) -> None:
        """Worker ``w`` died during a call: restart its episodes from scratch, on it or on the others."""
        self.stats.worker_failures += 1
        log.warning("rollout worker %d failed mid-batch (%s); re-running %d episodes", w, type(error).__name__, len(batch))
        fresh: list[_Episode] = []
        for ep in batch:
            ep.env.close()
            if ep.attempt >= self.config.max_attempts:
                raise RuntimeError(f"episode {ep.spec.episode_id} failed {ep.attempt} times; last: {error}") from error
            self._queue(self._start(ep.spec, ep.attempt + 1), w, fresh, done)
            self.stats.episode_reruns += 1
        alive[w] = self.pool.recover(w, self.config.recover_timeout_s)
        if alive[w]:
            pending[w] = fresh + pending[w]
            return
        moved, pending[w] = fresh + pending[w], []
        targets = [v for v in range(len(alive)) if alive[v]]
        if not targets:
            raise RuntimeError("every rollout worker is dead") from error
        for i, ep in enumerate(moved):
            pending[targets[i % len(targets)]].append(ep)
