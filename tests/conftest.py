"""Session-wide test set-up: CPU backends for DeepSpeed/vLLM, and ONE vLLM engine reused by every test that
needs one (engine start-up costs ~25-40 s of the 2 CPU cores)."""

from __future__ import annotations

import os

# Set before anything imports deepspeed / vllm / tokenizers.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the default wants a whole NUMA node
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is ~10x faster than two on the shared, loaded CI cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from marathon.tiny import write_tiny_qwen3

    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def _tiny_engine(model_dir):
    """A vLLM engine (vllm-cpu here) on a tiny fp32 checkpoint; yields it, shuts it down after the session."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def vllm_engine(tiny_qwen3_dir):
    """One in-process vLLM engine on the tiny Qwen3, shared by the whole session."""
    yield from _tiny_engine(tiny_qwen3_dir)


@pytest.fixture(scope="session")
def ray_local():
    """Ray started once per session, quiet (worker logs stay in Ray's log dir)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False,
             logging_level="ERROR", configure_logging=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def rollout_worker(ray_local, tiny_qwen3_dir):
    """One `RolloutWorker` Ray actor (its own vLLM engine) on the tiny model, shared by the session's rollout
    tests. Tests that change its weights put the originals back."""
    from rollout.worker import WorkerConfig, spawn_worker

    worker = spawn_worker(WorkerConfig(model=str(tiny_qwen3_dir), dtype="float32", max_model_len=1024), max_restarts=0)
    ray_local.get(worker.ready.remote())
    return worker


@pytest.fixture(scope="session")
def tiny_marathon_dir(tmp_path_factory):
    """A tiny random MarathonForCausalLM checkpoint (layout LSLG, fp32) with its tokenizer."""
    from rollout.vllm_plugin.tiny import write_tiny_marathon

    return write_tiny_marathon(tmp_path_factory.mktemp("tiny-marathon"))


@pytest.fixture(scope="session")
def marathon_engine(tiny_marathon_dir):
    """One vLLM engine serving the tiny Marathon model through our plugin (fp32), shared by the session."""
    yield from _tiny_engine(tiny_marathon_dir)
