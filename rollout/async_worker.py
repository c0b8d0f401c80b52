"""Async rollouts: vLLM's ``AsyncLLM`` in a Ray actor, every episode its own coroutine, envs beside the engine.

``AsyncRolloutWorker`` (a Ray async actor, ``spawn_worker(config, cls=AsyncRolloutWorker)``) runs episodes it is
handed (``start``) as coroutines: submit a turn, on return step the env (in a thread, under ``envs.guard``'s time
limit), submit the next turn. There is no barrier across episodes: vLLM's continuous batching interleaves
whatever turns are pending, and a finished episode waits in the worker's outbox until the driver ``take``s it.
Episode logic (prompts, masks, observations, truncation, infra failures) is ``EpisodeRunner``'s, shared with the
lock-step path; the env instances live in this process, next to the engine, never in the driver.

Weights change under running episodes (``update_weights``): vLLM's pause (requests kept) -> load -> resume
protocol, between two engine steps. The engine stamps each sampled token with the weight version that produced
it (``CompletionOutput.weight_versions``), so ``Trajectory.versions`` is exact per token, and each token's
logprob is its behaviour logprob under that version. The running requests' KV / linear-attention state is
recomputed under the new weights (``reset_prefix_cache(reset_running_requests=True)``: vLLM preempts them and
re-prefills their context), so a token after an update is a sample of the new policy given the same context.

It also serves the lock-step API (``generate``, ``ready``, ``update_weights``), so ``WorkerPool`` /
``EpisodeRunner`` / evaluation run on it unchanged. Seeds: async rollouts are not reproducible (which turns share
an engine step, and where a weight update lands, depend on timing), and vLLM's CPU sampler cannot honour
seeds under the partial prefills continuous batching does; per-request seeds are ignored here.

``EpisodeStream`` is the driver side: hands episodes to workers, takes finished ones back, and re-runs the
episodes of a worker that dies (each episode id comes back exactly once).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import os
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig, WorkerPool
from rollout.types import Trajectory
from rollout.worker import GenRequest, GenResult, WorkerConfig, cpu_tp_engine_kwargs

log = logging.getLogger(__name__)


def version_of(label: str | None, default: int) -> int:
    """vLLM's weight-version label as our int version ("default", before any update: ``default``)."""
    try:
        return int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


@dataclass
class EngineClock:
    """Busy time of an engine: time with at least one request in it (idle = wall - busy)."""

    active: int = 0
    busy_s: float = 0.0
    since: float = field(default_factory=time.perf_counter)
    _t: float = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._t = time.perf_counter()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += time.perf_counter() - self._t

    def busy(self) -> float:
        return self.busy_s + (time.perf_counter() - self._t if self.active else 0.0)


class _VersionView:
    """What ``EpisodeRunner`` reads of its pool: the version served (for an episode with no model token)."""

    def __init__(self, worker: AsyncRolloutWorker) -> None:
        self._worker = worker
        self.workers: list = []

    @property
    def version(self) -> int:
        return self._worker.version


class AsyncRolloutWorker:
    """One ``AsyncLLM`` engine and the episodes running on it. All methods are coroutines (a Ray async actor)."""

    def __init__(self, config: WorkerConfig) -> None:
        # The engine core runs in its own process (AsyncLLM always does); with this set, vLLM's CPU platform
        # keeps the model executor inside that process instead of a third one.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        if config.return_routed_experts:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.chat import ChatCodec

        self.config = config
        self.version = 0
        self.seeded = False
        args = AsyncEngineArgs(
            model=config.model, dtype=config.dtype, max_model_len=config.max_model_len, seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size, gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager, enable_prefix_caching=config.enable_prefix_caching,
            max_num_seqs=config.max_num_seqs, logprobs_mode=config.logprobs_mode,
            worker_extension_cls="rollout.worker.WeightSyncExtension",
            enable_return_routed_experts=config.return_routed_experts, disable_log_stats=True,
            **cpu_tp_engine_kwargs(config.tensor_parallel_size, config.engine_kwargs),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.tied_embeddings = bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))
        _reap_children_when_gone(os.getpid())
        self.codec = ChatCodec(AutoTokenizer.from_pretrained(config.model))
        self._ids = itertools.count()
        self._update_lock: asyncio.Lock | None = None
        self._runners: dict[RolloutConfig, EpisodeRunner] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._outbox: list[Trajectory] = []
        self._errors: list[str] = []
        self._arrived: asyncio.Event | None = None
        self.clock = EngineClock()
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                         "weight_updates": 0, "update_s": 0.0, "episodes": 0}

    # -- lock-step API (WorkerPool, EpisodeRunner, evaluation) --------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "version": self.version, "seeded": self.seeded, "async": True}

    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """All requests concurrently; results in request order."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in requests)))

    async def generate_one(self, r: GenRequest) -> GenResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if r.max_new_tokens < 1:
            raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        room = self.config.max_model_len - len(r.prompt_ids)
        if room < 1:
            return GenResult(r.request_id, [], [], "context", self.version, token_versions=[])
        params = SamplingParams(
            max_tokens=min(r.max_new_tokens, room), temperature=r.temperature, top_p=r.top_p,
            ignore_eos=r.ignore_eos, stop_token_ids=list(r.stop_token_ids), logprobs=0, detokenize=False,
            routed_experts_prompt_start=r.routed_experts_from, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        version_at_start = self.version
        final = None
        self.clock.enter()
        try:
            # a unique engine id: a re-run or a repeated turn id must not collide with a request still in flight
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(r.prompt_ids)), params,
                                                  request_id=f"{r.request_id}#{next(self._ids)}"):
                final = out
        finally:
            self.clock.leave()
        c = final.outputs[0]
        ids = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
        if c.weight_versions:
            versions = [version_of(s.version, version_at_start) for s in c.weight_versions
                        for _ in range(s.end - s.start)]
        else:  # no label reported (no token, or an engine without version tracking)
            versions = [version_at_start] * len(ids)
        if len(versions) != len(ids):
            raise RuntimeError(f"request {r.request_id}: {len(versions)} version labels for {len(ids)} tokens")
        reason = c.finish_reason
        if reason == "length" and len(ids) < r.max_new_tokens:
            reason = "context"
        experts = None if c.routed_experts is None else c.routed_experts.tolist()
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(r.prompt_ids)
        self.counters["cached_tokens"] += int(final.num_cached_tokens or 0)
        self.counters["generated_tokens"] += len(ids)
        return GenResult(r.request_id, ids, lps, reason, min(versions, default=self.version), experts, versions)

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                             version: int) -> float:
        """Load new weights between two engine steps, episodes in flight kept (pause -> load -> resume); their
        context is recomputed under the new weights. Returns seconds taken."""
        t0 = time.perf_counter()
        await self._load(dict(weights.items() if isinstance(weights, Mapping) else weights), version)
        return time.perf_counter() - t0

    # streamed updates (learner/weight_sync.py: the learner's rank 0 calls these in order). Buckets are assembled
    # while the episodes keep generating; the engine pauses only for the load itself, in `finish_weight_update`.
    async def begin_weight_update(self, version: int) -> None:
        from learner.weight_sync import BucketAssembler

        self._incoming = (version, BucketAssembler(), time.perf_counter(), {})

    async def load_weight_bucket(self, bucket: Any) -> int:
        version, assembler, _, whole = self._incoming
        if bucket.version != version:
            raise RuntimeError(f"weight bucket of version {bucket.version} during the update to {version}")
        done = assembler.add(bucket)
        whole.update((name, t.clone()) for name, t in done)  # own copies: the bucket's object may go away
        return len(done)

    async def finish_weight_update(self, version: int) -> float:
        expected, assembler, t0, whole = self._incoming
        if version != expected:
            raise RuntimeError(f"finishing the update to {version}, but {expected} was begun")
        assembler.check_done()
        await self._load(whole, version)
        self._incoming = None
        return time.perf_counter() - t0

    async def _load(self, named: dict[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        if self.tied_embeddings and "lm_head.weight" not in named:
            # a stream leaves the tied LM head out (HF checkpoints do); vLLM's in-place reload restores the head
            # as a layer of its own, which would keep the old weights: give it the embedding's
            embed = [k for k in named if k.endswith("embed_tokens.weight")]
            if len(embed) == 1:
                named = {**named, "lm_head.weight": named[embed[0]]}
        buf = io.BytesIO()
        torch.save({k: v.detach().contiguous() for k, v in named.items()}, buf)
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                await self.engine.collective_rpc("marathon_load_weights_blob", args=(buf.getvalue(),))
                await self.engine.update_weight_version(str(version))
                if not await self.engine.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
                self.version = version
            finally:
                await self.engine.resume_generation()
        self.counters["weight_updates"] += 1
        self.counters["update_s"] += time.perf_counter() - t0

    # -- continuous episodes ------------------------------------------------------------------------------------
    def _runner(self, rollout: RolloutConfig) -> EpisodeRunner:
        if rollout not in self._runners:
            self._runners[rollout] = EpisodeRunner(_VersionView(self), self.codec, rollout)  # type: ignore[arg-type]
        return self._runners[rollout]

    async def start(self, episodes: Sequence[tuple[EpisodeSpec, int]], rollout: RolloutConfig) -> int:
        """Start ``(spec, attempt)`` episodes as coroutines; returns at once (the number now running)."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        runner = self._runner(rollout)
        for spec, attempt in episodes:
            key = f"{spec.episode_id}/{attempt}"
            if key in self._tasks:
                raise ValueError(f"episode {key} is already running on this worker")
            self._tasks[key] = asyncio.get_running_loop().create_task(self._episode(runner, spec, attempt, key))
        return len(self._tasks)

    async def _episode(self, runner: EpisodeRunner, spec: EpisodeSpec, attempt: int, key: str) -> None:
        ep = None
        try:
            ep = await asyncio.to_thread(runner._start, spec, attempt)
            if ep.finish != "infra_failure":
                while True:
                    result = await self.generate_one(runner._request(ep))
                    if not await asyncio.to_thread(runner._advance, ep, result):
                        break
            traj = await asyncio.to_thread(runner._trajectory, ep, -1)
            self._outbox.append(traj)
            self.counters["episodes"] += 1
        except asyncio.CancelledError:
            if ep is not None and ep.env is not None:
                ep.env.close()
            raise
        except Exception:  # noqa: BLE001 - a bug, not an env fault (those are data): reported to the driver
            self._errors.append(f"episode {key}: {traceback.format_exc()}")
        finally:
            self._tasks.pop(key, None)
            self._arrived.set()

    async def take(self, wait_s: float = 1.0) -> list[Trajectory]:
        """Finished episodes since the last call (each handed out once); waits up to ``wait_s`` for one."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        if not self._outbox and not self._errors:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        if self._errors:
            raise RuntimeError("an episode failed inside the rollout worker:\n" + self._errors[0])
        out, self._outbox = self._outbox, []
        return out

    async def cancel(self, keys: Sequence[str] = ()) -> int:
        """Stop running episodes (``episode_id/attempt`` keys; all when empty); returns how many."""
        victims = [t for k, t in self._tasks.items() if not keys or k in keys]
        for t in victims:
            t.cancel()
        await asyncio.gather(*victims, return_exceptions=True)
        return len(victims)

    async def run(self, specs: Sequence[EpisodeSpec], rollout: RolloutConfig) -> list[Trajectory]:
        """Run ``specs`` to the end (benchmarks, tests); trajectories in spec order."""
        await self.start([(s, 1) for s in specs], rollout)
        done: dict[str, Trajectory] = {}
        while len(done) < len(specs):
            for t in await self.take(5.0):
                done[t.episode_id] = t
        return [done[s.episode_id] for s in specs]

    async def stats(self) -> dict[str, Any]:
        """Counters since start: engine busy / wall seconds, requests, prompt tokens and how many of them came
        from vLLM's prefix cache (``cached_tokens``), generated tokens, weight updates, running episodes."""
        return {**self.counters, "busy_s": self.clock.busy(), "wall_s": time.perf_counter() - self.clock.since,
                "running": len(self._tasks), "version": self.version}

    async def shutdown(self) -> None:
        await self.cancel()
        self.engine.shutdown()


_WATCHDOG = """
import os, sys, time, signal
parent, kids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while True:
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        break
    time.sleep(1.0)
for pid in kids:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def _reap_children_when_gone(pid: int) -> None:
    """The engine core is a child process of the actor; if the actor dies abruptly (killed, os._exit), nothing
    stops it. A tiny watchdog process kills the actor's children once the actor's pid is gone."""
    import subprocess
    import sys

    import psutil

    kids = [str(p.pid) for p in psutil.Process(pid).children(recursive=True)]
    if kids:
        subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(pid), *kids], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- driver side ----------------------------------------------------------------------------------------------
@dataclass
class StreamStats:
    submitted: int = 0
    returned: int = 0
    worker_failures: int = 0
    episode_reruns: int = 0
    ignored_duplicates: int = 0


class EpisodeStream:
    """Episodes flowing through ``AsyncRolloutWorker`` actors: ``submit`` hands them out (to the worker with the
    fewest running), ``poll`` returns those that finished. Each episode id is returned exactly once: a worker
    that dies loses its running episodes, which re-run from scratch (attempt + 1) on it once Ray has restarted
    it (with the pool's current weights re-sent), or on the others; a result for an attempt that is no longer
    current is ignored."""

    def __init__(self, pool: WorkerPool, rollout: RolloutConfig, take_wait_s: float = 0.5) -> None:
        self.pool, self.rollout, self.take_wait_s = pool, rollout, take_wait_s
        n = len(pool.workers)
        self.alive = [True] * n
        self.running: dict[str, tuple[EpisodeSpec, int, int]] = {}  # episode id -> (spec, attempt, worker)
        self._takes: dict[Any, int] = {}  # outstanding take() ref -> worker
        self.stats = StreamStats()

    @property
    def outstanding(self) -> int:
        return len(self.running)

    def load(self, w: int) -> int:
        return sum(1 for _, _, v in self.running.values() if v == w)

    def submit(self, specs: Sequence[EpisodeSpec], attempt: int = 1) -> None:
        by_worker: dict[int, list[tuple[EpisodeSpec, int]]] = {}
        live = [w for w in range(len(self.alive)) if self.alive[w]]
        if not live:
            raise RuntimeError("every rollout worker is dead")
        loads = {w: self.load(w) for w in live}
        for spec in specs:
            if spec.episode_id in self.running:
                raise ValueError(f"episode {spec.episode_id} is already running")
            w = min(live, key=lambda v: (loads[v], v))
            loads[w] += 1
            self.running[spec.episode_id] = (spec, attempt, w)
            by_worker.setdefault(w, []).append((spec, attempt))
            self.stats.submitted += attempt == 1
        for w, eps in by_worker.items():
            self._start(w, eps)

    def _start(self, w: int, eps: list[tuple[EpisodeSpec, int]]) -> None:
        import ray

        try:
            ray.get(self.pool.workers[w].start.remote(eps, self.rollout))
        except ray.exceptions.RayActorError as e:
            self._worker_died(w, e)

    def poll(self, timeout_s: float = 1.0) -> list[Trajectory]:
        """Episodes finished since the last poll (waits up to ``timeout_s`` for the first)."""
        import ray

        for w in range(len(self.alive)):
            if self.alive[w] and w not in self._takes.values() and self.load(w):
                self._takes[self.pool.workers[w].take.remote(self.take_wait_s)] = w
        if not self._takes:
            return []
        refs = list(self._takes)
        if ray.wait(refs, num_returns=1, timeout=timeout_s)[0]:
            ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0]  # all that are done by now
        else:
            ready = []
        out: list[Trajectory] = []
        for ref in ready:
            w = self._takes.pop(ref)
            try:
                trajs = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._worker_died(w, e)
                continue
            for t in trajs:
                current = self.running.get(t.episode_id)
                if current is None or current[1] != t.info.get("attempts") or current[2] != w:
                    self.stats.ignored_duplicates += 1  # a superseded attempt: never counted twice
                    continue
                del self.running[t.episode_id]
                t.info["worker"] = w
                out.append(t)
                self.stats.returned += 1
        return out

    def _worker_died(self, w: int, error: Exception) -> None:
        """Worker ``w`` is gone mid-stream: its running episodes re-run from scratch (on it once restarted)."""
        self.stats.worker_failures += 1
        lost = [(spec, attempt) for spec, attempt, v in self.running.values() if v == w]
        for ref in [r for r, v in self._takes.items() if v == w]:
            del self._takes[ref]
        log.warning("async rollout worker %d died (%s); re-running its %d episodes", w, type(error).__name__, len(lost))
        for spec, attempt in lost:
            if attempt >= self.rollout.max_attempts:
                raise RuntimeError(f"episode {spec.episode_id} failed {attempt} times; last: {error}") from error
            del self.running[spec.episode_id]
        self.alive[w] = self.pool.recover(w, self.rollout.recover_timeout_s)
        for spec, attempt in lost:
            self.stats.episode_reruns += 1
            self.submit([spec], attempt=attempt + 1)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> list[float]:
        """New weights to every live worker (episodes keep running); a worker that dies meanwhile gets them when
        it is back (``WorkerPool.recover``)."""
        import ray

        named = [(k, v.detach().contiguous()) for k, v in weights.items()]
        ref = ray.put(named)
        self.pool._weights_ref, self.pool.version = ref, version
        calls = {w: self.pool.workers[w].update_weights.remote(ref, version)
                 for w in range(len(self.alive)) if self.alive[w]}
        seconds = []
        for w, call in calls.items():
            try:
                seconds.append(ray.get(call))
            except ray.exceptions.RayActorError as e:
                self._worker_died(w, e)
        return seconds

    def worker_stats(self) -> list[dict[str, Any] | None]:
        import ray

        out = []
        for w, worker in enumerate(self.pool.workers):
            try:
                out.append(ray.get(worker.stats.remote()) if self.alive[w] else None)
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def close(self) -> None:
        """Stop every running episode (their results are dropped)."""
        import ray

        for w, worker in enumerate(self.pool.workers):
            if self.alive[w]:
                try:
                    ray.get(worker.cancel.remote([]))
                except ray.exceptions.RayActorError:
                    pass
        self.running.clear()
        self._takes.clear()
