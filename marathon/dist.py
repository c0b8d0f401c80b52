"""Process-group set-up shared by the learner and tools: one rank with gloo when not launched by a launcher."""

from __future__ import annotations

import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group() -> None:
    """Initialise torch.distributed through DeepSpeed for a single local rank, unless already initialised."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if os.environ.get("WORLD_SIZE", "1") == "1":
        # A fresh port every time: a MASTER_PORT inherited from a parent process (a Ray actor inherits the
        # driver's environment) may be bound by that parent's own store.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
