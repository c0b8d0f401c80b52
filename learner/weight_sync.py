"""Streamed weight sync: the learner's weights reach the rollout workers bucket by bucket, never as one copy.

The learner's tensors (HF checkpoint names, in ``state_dict`` order: layer by layer) are cut into buckets of
about ``bucket_bytes`` in the transfer dtype (bf16 for a bf16 rollout; a tensor larger than a bucket travels in
row pieces of at most a bucket). For each bucket every rank enters ``deepspeed.zero.GatheredParameters`` for
its parameters (ZeRO-3 shards are gathered one bucket at a time; a no-op for ZeRO 0-2), rank 0 packs them into
one flat buffer (`WeightBucket`), puts it into Ray's object store and hands the reference to every rollout
worker (``load_weight_bucket``); at most ``depth`` buckets are in flight (rank 0 waits for the workers to load
the oldest before packing another), so the object store holds at most ``depth`` buckets and the driver none:
it only passes actor handles. The policy version travels with every bucket and with the begin/finish calls.

On the worker side (``rollout.worker``) one vLLM in-place reload spans the whole stream: it begins before the
first bucket, each bucket goes through the model's ``load_weights`` (layers are processed as soon as all their
tensors arrived; a tensor sent in pieces is assembled first, `BucketAssembler`), and it finishes after the last.

Peak memory: learner rank 0 holds one bucket's gathered parameters plus the packed buffer; every other rank its
shards plus one bucket's gathered parameters; the object store ``depth`` buckets; a worker the bucket it loads
(read in place from the object store) and at most one tensor being assembled. `sync_seconds_per_gb` and the
tests measure it.

`save_hf_streamed` writes an HF checkpoint (safetensors shards) from the same bucket stream: an export needs no
whole-model copy either.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.float16, torch.float32: torch.float32}


@dataclass(frozen=True)
class Entry:
    """Rows [row_start, row_start + rows) of tensor ``name`` (shape ``shape``) at ``offset`` elements in a bucket."""

    name: str
    shape: tuple[int, ...]
    row_start: int
    rows: int
    offset: int

    @property
    def row_numel(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel if self.shape else 1

    @property
    def whole(self) -> bool:
        return self.row_start == 0 and (not self.shape or self.rows == self.shape[0])


@dataclass
class WeightBucket:
    """One bucket of a stream: tensor pieces laid out back to back in ``data`` (a numpy array, so Ray's object
    store hands it to readers without a copy; bf16 travels as int16 bits)."""

    version: int
    index: int
    dtype: str
    entries: list[Entry]
    data: np.ndarray
    last: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def pieces(self) -> Iterator[tuple[Entry, torch.Tensor]]:
        """(entry, tensor view of its rows) without copying ``data`` (read-only when it lives in the store)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only object-store buffer: we only read it
            flat = torch.from_numpy(self.data)
        flat = flat.view(DTYPES[self.dtype])
        for e in self.entries:
            view = flat[e.offset : e.offset + e.numel]
            yield e, view.view(e.rows, *e.shape[1:]) if e.shape else view.view(())


class BucketAssembler:
    """Turns a stream of buckets into whole (name, tensor) pairs: whole tensors as views into the bucket, tensors
    sent in pieces assembled into one buffer (released once complete)."""

    def __init__(self) -> None:
        self.partial: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
        out = []
        for e, t in bucket.pieces():
            if e.whole:
                out.append((e.name, t))
                continue
            buf, filled = self.partial.get(e.name) or (torch.empty(e.shape, dtype=t.dtype), 0)
            buf[e.row_start : e.row_start + e.rows].copy_(t)
            filled += e.rows
            if filled == e.shape[0]:
                self.partial.pop(e.name, None)
                out.append((e.name, buf))
            else:
                self.partial[e.name] = (buf, filled)
        return out

    def check_done(self) -> None:
        if self.partial:
            raise RuntimeError(f"weight stream ended with incomplete tensors: {sorted(self.partial)[:5]}")


# -- the learner side -------------------------------------------------------------------------------------------
def plan_buckets(shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int, elem_bytes: int) -> list[list[Entry]]:
    """Tensors (in order) -> buckets of at most ``bucket_bytes``. Tensors that fit share buckets; a tensor larger
    than a bucket gets buckets of its own, cut by rows (a single row larger than a bucket travels alone), so each
    parameter is gathered once, with no other tensor's rows waiting on it."""
    cap = max(1, bucket_bytes // elem_bytes)  # elements per bucket
    buckets: list[list[Entry]] = []
    cur: list[Entry] = []
    used = 0
    for name, shape in shapes:
        shape = tuple(int(s) for s in shape)
        rows = shape[0] if shape else 1
        row_numel = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        numel = rows * row_numel
        if numel > cap - used and cur:  # does not fit what is left: close the bucket
            buckets.append(cur)
            cur, used = [], 0
        if numel <= cap:
            cur.append(Entry(name, shape, 0, rows, used))
            used += numel
            continue
        per = max(1, cap // row_numel)
        for start in range(0, rows, per):
            buckets.append([Entry(name, shape, start, min(per, rows - start), 0)])
    if cur:
        buckets.append(cur)
    return buckets


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's checkpoint tensors by name (parameters as the ZeRO-3 objects, not gathered), each tensor
    once: a name aliasing an earlier one (a tied LM head) is left out, as HF checkpoints and vLLM leave it."""
    seen: set[int] = set()
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)


def iter_buckets(module: torch.nn.Module, version: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: str = "bfloat16", pack: bool = True) -> Iterator[WeightBucket | None]:
    """The weight stream of ``module``. Every rank of a ZeRO-3 group must iterate it (each bucket's gather is a
    collective); ranks with ``pack=False`` get None per bucket and hold no packed copy."""
    import deepspeed

    tdtype = DTYPES[dtype]
    named = _named_tensors(module)
    tensors = dict(named)
    plan = plan_buckets([(n, _full_shape(t)) for n, t in named], bucket_bytes, torch.empty((), dtype=tdtype).element_size())
    # buckets joined by a tensor that spans them are gathered together (each parameter gathered once)
    groups: list[list[int]] = []
    for index, entries in enumerate(plan):
        if groups and entries[0].row_start > 0:
            groups[-1].append(index)
        else:
            groups.append([index])
    for group in groups:
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for e in (e for index in group for e in plan[index]):
            t = tensors[e.name]
            if hasattr(t, "ds_id") and id(t) not in seen:
                seen.add(id(t))
                params.append(t)
        with deepspeed.zero.GatheredParameters(params, enabled=bool(params)):
            for index in group:
                if not pack:
                    yield None
                    continue
                entries = plan[index]
                flat = torch.empty(sum(e.numel for e in entries), dtype=tdtype)
                for e in entries:
                    src = tensors[e.name].detach().reshape(-1)
                    flat[e.offset : e.offset + e.numel].copy_(src[e.row_start * e.row_numel : (e.row_start + e.rows) * e.row_numel])
                yield WeightBucket(version, index, dtype, entries, flat.view(_NUMPY_VIEW[tdtype]).numpy(),
                                   last=index == len(plan) - 1)
                del flat


class PeakRSS:
    """Peak growth of this process's resident memory while the block runs, sampled every ``every_s`` seconds from
    /proc (Linux): ``peak`` of private memory (RssAnon: copies this process made) and ``peak_shared`` of shared
    memory (RssShmem: object-store pages it mapped, which belong to the store). Run with a fixed
    ``MALLOC_MMAP_THRESHOLD_`` (e.g. 65536) so that freed buffers leave the process instead of staying in glibc's
    heap, or the figure is the allocator's high-water mark."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak, self.peak_shared = every_s, 0, 0
        self.base = (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> tuple[int, int]:
        """(RssAnon, RssShmem) bytes."""
        fields = {"RssAnon": 0, "RssShmem": 0}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    fields[key] = int(value.split()[0]) * 1024
        return fields["RssAnon"], fields["RssShmem"]

    def _update(self) -> None:
        anon, shm = self.rss()
        self.peak = max(self.peak, anon - self.base[0])
        self.peak_shared = max(self.peak_shared, shm - self.base[1])

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._update()
            time.sleep(self.every_s)

    def __enter__(self) -> "PeakRSS":
        self.base = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()


@dataclass
class SyncStats:
    version: int
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0  # gathering + packing on the learner (the rest: the workers' loading, overlapped)
    worker_seconds: list[float] = field(default_factory=list)
    peak_rss: int | None = None  # with measure_memory: this process's peak private memory growth (PeakRSS)
    peak_shared: int | None = None  # ... and of shared (object-store) pages it mapped
    largest_tensor_bytes: int = 0  # the largest gathered tensor (ZeRO-3 gathers whole parameters)

    @property
    def seconds_per_gb(self) -> float:
        return self.seconds / max(self.bytes / 1e9, 1e-12)

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "buckets": self.buckets, "gb": self.bytes / 1e9, "seconds": self.seconds,
                "pack_seconds": self.pack_seconds, "seconds_per_gb": self.seconds_per_gb,
                "worker_seconds": self.worker_seconds, "peak_rss": self.peak_rss,
                "peak_shared": self.peak_shared, "largest_tensor_bytes": self.largest_tensor_bytes}


def stream_to_workers(module: torch.nn.Module, workers: list[Any] | None, version: int,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: str = "bfloat16", depth: int = 2,
                      measure_memory: bool = False) -> SyncStats:
    """Send ``module``'s weights to rollout worker actors (``RolloutWorker``: begin/load/finish_weight_update).
    Call on every rank of the learner group; rank 0 (the one given ``workers``) sends, the others only take part
    in the ZeRO-3 gathers. Returns the stream's statistics (rank 0's are the real ones)."""
    if measure_memory:
        import gc

        gc.collect()
        with PeakRSS() as meter:
            stats = stream_to_workers(module, workers, version, bucket_bytes, dtype, depth)
        stats.peak_rss, stats.peak_shared = meter.peak, meter.peak_shared
        return stats
    stats = SyncStats(version)
    stats.largest_tensor_bytes = max((int(np.prod(_full_shape(t), dtype=np.int64)) * t.element_size()
                                      for _, t in _named_tensors(module)), default=0)
    t0 = time.perf_counter()
    sender = workers is not None and (not dist.is_initialized() or dist.get_rank() == 0)
    if not sender:
        for _ in iter_buckets(module, version, bucket_bytes, dtype, pack=False):
            pass
        return stats
    import ray

    ray.get([w.begin_weight_update.remote(version) for w in workers])
    inflight: deque[list[Any]] = deque()
    it = iter_buckets(module, version, bucket_bytes, dtype)
    while True:
        tp = time.perf_counter()
        bucket = next(it, None)
        stats.pack_seconds += time.perf_counter() - tp
        if bucket is None:
            break
        ref = ray.put(bucket)
        stats.buckets += 1
        stats.bytes += bucket.nbytes
        del bucket  # the store holds the only copy now
        inflight.append([w.load_weight_bucket.remote(ref) for w in workers])
        del ref
        while len(inflight) >= depth:
            ray.get(inflight.popleft())
    while inflight:
        ray.get(inflight.popleft())
    stats.worker_seconds = ray.get([w.finish_weight_update.remote(version) for w in workers])
    stats.seconds = time.perf_counter() - t0
    return stats


class TensorSink:
    """A rollout-worker stand-in for benchmarks and tests: model-sized tensors that a stream loads into in place
    (through `BucketAssembler`, like the worker), with its own peak memory growth over each update."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: str = "float32") -> None:
        self.tensors = {k: torch.zeros(s, dtype=DTYPES[dtype]) for k, s in shapes.items()}
        self.version = 0
        self.peak_rss = self.peak_shared = 0

    def begin_weight_update(self, version: int) -> None:
        import gc

        gc.collect()
        self._asm, self._meter, self._t0 = BucketAssembler(), PeakRSS().__enter__(), time.perf_counter()

    def load_weight_bucket(self, bucket: WeightBucket) -> int:
        loaded = self._asm.add(bucket)
        for name, t in loaded:
            self.tensors[name].copy_(t)
        return len(loaded)

    def finish_weight_update(self, version: int) -> float:
        self._asm.check_done()
        self._meter.__exit__(None, None, None)
        self.peak_rss, self.peak_shared, self.version = self._meter.peak, self._meter.peak_shared, version
        return time.perf_counter() - self._t0

    def peak(self) -> tuple[int, int]:
        """(private, shared) peak growth during the last update."""
        return self.peak_rss, self.peak_shared

    def checksum(self) -> dict[str, float]:
        return {k: float(v.double().sum()) for k, v in self.tensors.items()}


def save_hf_streamed(module: torch.nn.Module, path: str | Path, config: Any, shard_bytes: int = 4 << 30,
                     dtype: str | None = None) -> str | None:
    """Write ``module`` as an HF checkpoint (``config`` + safetensors shards of about ``shard_bytes``) from the
    weight stream. Every rank calls it (ZeRO-3 gathers); rank 0 writes. Tied tensors are written once."""
    from safetensors.torch import save_file

    path = Path(path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dtype is None:
        first = next(iter(module.parameters()))
        dtype = {v: k for k, v in DTYPES.items()}[first.dtype]
    files: dict[str, str] = {}
    shard_index = 0
    assembler = BucketAssembler()
    if rank0:
        path.mkdir(parents=True, exist_ok=True)
    for bucket in iter_buckets(module, 0, shard_bytes, dtype, pack=rank0):
        if bucket is None:
            continue
        tensors = {n: t.contiguous() for n, t in assembler.add(bucket)}
        if not tensors:
            continue
        shard_index += 1
        name = f"model-{shard_index:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        files.update({n: name for n in tensors})
        del tensors, bucket
    if not rank0:
        return None
    assembler.check_done()
    # final names: model-0000i-of-0000N
    n = shard_index
    renamed = {}
    for i in range(1, n + 1):
        old, new = f"model-{i:05d}.safetensors", ("model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors")
        (path / old).rename(path / new)
        renamed[old] = new
    if n > 1:
        total = sum((path / f).stat().st_size for f in renamed.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(files.items())}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(str(path))
    return str(path)

