"""Streamed weight sync (learner/weight_sync.py): seconds per GB and peak memory per process.

    python benchmarks/weight_sync/bench.py ray --ranks 2 --hidden 1024 --layers 8 --bucket-mb 32 --dtype bfloat16
    python benchmarks/weight_sync/bench.py gather --ranks 2 ...     # no Ray: the ZeRO-3 gather + pack side alone

``ray``: a ZeRO-3 `LearnerGroup` of ``--ranks`` CPU ranks streams a random Qwen3-shaped checkpoint to
``--workers`` `TensorSink` actors (rollout-worker stand-ins that load each bucket into model-sized tensors); every
process measures its peak private (RssAnon) and shared (RssShmem: object-store pages) memory growth during the
stream. ``gather``: ranks started by ``learner.dist.spawn_ranks`` (CPU/gloo, or one GPU each with NCCL when CUDA
is there) run the learner side only (gather every bucket from the shards, pack it into a host buffer): its
seconds per GB and peak memory (on GPUs: ``torch.cuda.max_memory_allocated`` growth). Results: one JSON line per
run on stdout. Freed buffers leave each process at once (``MALLOC_MMAP_THRESHOLD_``) so RSS reads what is alive.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def write_model(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def run_ray(args, model_dir: Path) -> dict:
    import ray
    from safetensors import safe_open

    from configs.schema import LearnerSection
    from learner.group import LearnerGroup
    from learner.weight_sync import TensorSink

    ray.init(num_cpus=args.ranks + args.workers + 1, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    env = {"DS_ACCELERATOR": "cpu", **MALLOC}
    cfg = LearnerSection(zero_stage=3, num_ranks=args.ranks, num_cpus=1, dtype=args.dtype,
                         weight_sync_bucket_mb=args.bucket_mb)
    group = LearnerGroup(model_dir, cfg, env_vars=env)
    sinks = [ray.remote(TensorSink).options(num_cpus=1, runtime_env={"env_vars": MALLOC}).remote(shapes, args.dtype)
             for _ in range(args.workers)]
    try:
        rows = []
        for rep in range(args.repeats):
            stats = group.call_all_per_rank("stream_weights", [(sinks if i == 0 else None, rep + 1) for i in range(args.ranks)],
                                            {"measure_memory": True})
            peaks = ray.get([s.peak.remote() for s in sinks])
            r0 = stats[0]
            rows.append({"gb": r0["gb"], "buckets": r0["buckets"], "seconds": r0["seconds"],
                         "seconds_per_gb": r0["seconds_per_gb"], "pack_seconds": r0["pack_seconds"],
                         "largest_tensor_mib": r0["largest_tensor_bytes"] / 2**20,
                         "peak_private_mib": {"learner": [s["peak_rss"] / 2**20 for s in stats],
                                              "workers": [p[0] / 2**20 for p in peaks]},
                         "peak_shared_mib": {"learner_rank0": r0["peak_shared"] / 2**20,
                                             "workers": [p[1] / 2**20 for p in peaks]}})
        return {"mode": "ray", **vars(args), "model_mib": sum(4 * _numel(s) for s in shapes.values()) / 2**20,
                "runs": rows}
    finally:
        group.shutdown()
        ray.shutdown()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gather_rank(rank: int, model_dir: str, dtype: str, bucket_mb: int, repeats: int) -> dict:
    import gc

    import torch

    from configs.schema import LearnerSection
    from learner.engine import Learner
    from learner.weight_sync import PeakRSS, iter_buckets

    learner = Learner(model_dir, LearnerSection(zero_stage=3, dtype=dtype), seed=0)
    cuda = learner.device.type == "cuda"
    out = []
    for _ in range(repeats):
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        nbytes, t0 = 0, time.perf_counter()
        with PeakRSS() as meter:
            for b in iter_buckets(learner.module, 0, bucket_mb << 20, dtype, pack=rank == 0):
                nbytes += b.nbytes if b is not None else 0
        seconds = time.perf_counter() - t0
        row = {"seconds": seconds, "gb": nbytes / 1e9, "peak_private_mib": meter.peak / 2**20}
        if cuda:
            row["peak_cuda_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        if rank == 0:
            row["seconds_per_gb"] = seconds / max(nbytes / 1e9, 1e-12)
        out.append(row)
    return {"device": str(learner.device), "runs": out}


def run_gather(args, model_dir: Path) -> dict:
    from learner.dist import spawn_ranks

    os.environ.update(MALLOC)
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
    res = spawn_ranks(_gather_rank, args.ranks, str(model_dir), args.dtype, args.bucket_mb, args.repeats)
    return {"mode": "gather", **vars(args), "ranks_out": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["ray", "gather"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_model(Path(d) / "model", args.hidden, args.layers, args.vocab)
        t0 = time.perf_counter()
        res = run_ray(args, model_dir) if args.mode == "ray" else run_gather(args, model_dir)
        res["wall_s"] = time.perf_counter() - t0
        res["loadavg"] = os.getloadavg()
        print(json.dumps(res))


if __name__ == "__main__":
    main()
