"""Process groups of the learner: one process per rank, with or without Ray.

``init_distributed(context_parallel_size)`` joins (or starts) the default ``torch.distributed`` group through
DeepSpeed and returns this rank's `RankLayout`:

- launched by a launcher (torchrun, ``deepspeed``, `learner.group` on Ray, `spawn_ranks` in tests): the usual
  environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) names the group;
- otherwise one local rank (world size 1) on a fresh port.

The backend is gloo on CPU (``DS_ACCELERATOR=cpu``) and NCCL on GPUs; a GPU rank uses its ``LOCAL_RANK`` device.

Rank layout: ``world = DP x CP``. The ``cp`` ranks of one data-parallel replica are consecutive
(``rank = dp_rank * cp + cp_rank``), so a CP group stays inside a node when ranks are packed per node. DeepSpeed's
data-parallel group is the whole world: ZeRO shards over every rank, and the CP ranks' partial gradients are
summed by the same reduction (`learner.data_parallel` scales the loss so the average over the world is the
global token mean). The learner gets the CP process group from ``layout.cp_group`` (`learner.context_parallel`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> str:
    """An address of this node that the other ranks can reach (the one its default route uses)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def on_cpu() -> bool:
    return os.environ.get("DS_ACCELERATOR") == "cpu"


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits in the ``dp x cp`` grid, and its groups (None where the group is the whole world or
    a single rank)."""

    rank: int = 0
    world_size: int = 1
    cp_size: int = 1
    cp_group: Any = None  # this rank's context-parallel group (cp_size ranks), None when cp_size == 1
    dp_group: Any = None  # ranks with the same cp_rank (one per replica), None when cp_size == 1 (the world)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world_size} (DP {self.dp_rank}/{self.dp_size} x CP {self.cp_rank}/{self.cp_size})"


def layout_problem(world_size: int, cp_size: int) -> str | None:
    """Why ``world_size`` ranks cannot be laid out as DP x ``cp_size`` (None: they can)."""
    if world_size < 1 or cp_size < 1:
        return f"need at least one rank and a CP size >= 1, got {world_size} ranks and CP {cp_size}"
    if world_size % cp_size:
        return f"a context-parallel size of {cp_size} does not divide the {world_size} learner ranks"
    return None


_LAYOUT: RankLayout | None = None


def init_distributed(context_parallel_size: int = 1) -> RankLayout:
    """Join the default process group (started here if needed) and build the DP x CP groups once per process."""
    global _LAYOUT
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A fresh port every time: a MASTER_PORT inherited from a parent process (a Ray actor inherits the
            # driver's environment) may be bound by that parent's own store.
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                              WORLD_SIZE="1")
        if not on_cpu():
            from deepspeed.accelerator import get_accelerator

            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend="gloo" if on_cpu() else None, verbose=False)
        _LAYOUT = None
    rank, world = dist.get_rank(), dist.get_world_size()
    if _LAYOUT is not None and (_LAYOUT.world_size, _LAYOUT.cp_size) == (world, context_parallel_size):
        return _LAYOUT
    problem = layout_problem(world, context_parallel_size)
    if problem:
        raise ValueError(problem)
    cp, layout = context_parallel_size, RankLayout(rank, world, context_parallel_size)
    if cp > 1:
        # every rank creates every group, in the same order (torch.distributed.new_group is collective)
        cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(world // cp)]
        dp_groups = [dist.new_group(list(range(c, world, cp))) for c in range(cp)]
        layout = RankLayout(rank, world, cp, cp_groups[rank // cp], dp_groups[rank % cp])
    _LAYOUT = layout
    return layout


def init_single_process_group() -> None:
    """One local rank unless a launcher set up more (the learner's and tools' old entry point)."""
    init_distributed(1)


def spawn_ranks(fn, world_size: int, *args, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes forming one process group (gloo on CPU, NCCL on
    GPUs: the launcher for machines without Ray, and for tests); returns each rank's result, rank order.
    ``fn`` must be importable (a module-level function)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, queue, args), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"rank process(es) died: exit codes {[p.exitcode for p in dead]}")
                continue
            if ok:
                results[rank] = _loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _dumps(value: Any) -> bytes:
    """Tensors by value (a queue would pass shared-memory handles that die with the rank's process)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(fn, rank: int, world_size: int, port: int, queue, args) -> None:
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        out = fn(rank, *args)
        queue.put((rank, True, _dumps(out)))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
