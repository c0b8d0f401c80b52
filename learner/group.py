"""``LearnerGroup``: N learner ranks as Ray actors, driven like the one learner actor it replaces.

A placement group reserves one bundle per rank (``{"CPU": num_cpus, "GPU": num_gpus}``, packed per node, so a
replica's context-parallel ranks, which are consecutive, share a node); rank 0's actor reports its node address
and a free port, and every actor then joins one ``torch.distributed`` group through the usual environment
(``learner.dist``: gloo on CPU, NCCL on GPUs) and builds its `Learner` (a DeepSpeed rank; under ZeRO-3 the model
is built partitioned). Everything else is plain: ``group.train_rl.remote(...)`` calls ``train_rl`` on every rank
with the same arguments (large ones put once into the object store) and returns ONE object ref, to rank 0's
result, so the driver's ``ray.get(learner.X.remote(...))`` is unchanged. Failures: a group whose rank failed
cannot go on (its collectives no longer match), so a rank > 0 that raises, and any rank whose collective fails
(``torch.distributed.DistError``: a peer died), ends its process; rank 0's ref then raises Ray's
``ActorDiedError``, which the driver answers by restarting the actors from the last checkpoint. Rank 0's own
errors (the same on every rank, e.g. a bad argument) propagate as they are. ``group.call(name, ...)`` is the
blocking form (every rank's result awaited, the first error raised).

Only this file uses Ray: ranks launched any other way (torchrun, ``learner.dist.spawn_ranks``) run the same
`Learner` code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from configs.schema import LearnerSection

PG_TIMEOUT_S = float(os.environ.get("MARATHON_PG_TIMEOUT_S", "600"))


class LearnerRank:
    """One rank (the Ray actor's class): a `Learner` once ``start`` has joined the process group."""

    def __init__(self) -> None:
        self.learner = None

    def address(self) -> tuple[str, int]:
        from learner.dist import free_port, node_address

        return node_address(), free_port()

    def start(self, rank: int, world_size: int, master: tuple[str, int], model_dir: str, cfg: LearnerSection,
              kwargs: dict[str, Any], learner_cls: type | None = None) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        from learner.engine import Learner

        self.learner = (learner_cls or Learner)(model_dir, cfg, **kwargs)
        return str(self.learner.layout)

    def call(self, method: str, *args, **kwargs) -> Any:
        try:
            return getattr(self.learner, method)(*args, **kwargs)
        except Exception as e:
            import torch.distributed as dist

            if self.learner is not None and self.learner.layout.world_size > 1 and (
                    self.learner.layout.rank > 0 or isinstance(e, dist.DistError)):
                import traceback

                traceback.print_exc()
                os._exit(1)  # the group is broken: end this rank so that the driver restarts the group
            raise

    def pid(self) -> int:
        return os.getpid()


class LearnerGroup:
    """The learner of a run stage: ``num_ranks`` ranks (``context_parallel_size`` of them per replica)."""

    def __init__(self, model_dir: str | Path, cfg: LearnerSection, seed: int = 0, zero_stage: int | None = None,
                 gradient_checkpointing: bool | None = None, micro_batch_tokens: int | None = None,
                 num_ranks: int | None = None, context_parallel_size: int | None = None,
                 env_vars: dict[str, str] | None = None, learner_cls: type | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from learner.dist import layout_problem

        self.num_ranks = num_ranks or cfg.num_ranks
        cp = context_parallel_size or cfg.context_parallel_size
        problem = layout_problem(self.num_ranks, cp)
        if problem:
            raise ValueError(problem)
        bundle = {k: v for k, v in {"CPU": cfg.num_cpus, "GPU": cfg.num_gpus}.items() if v > 0} or {"CPU": 0.01}
        self.ranks: list[Any] = []
        self._starting: list[Any] | None = None
        self._others: list[Any] = []
        self.pg = placement_group([dict(bundle) for _ in range(self.num_ranks)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PG_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"the cluster cannot place {self.num_ranks} learner ranks of {bundle} each within "
                               f"{PG_TIMEOUT_S:.0f} s (resources: {ray.cluster_resources()})")
        actor = ray.remote(LearnerRank)
        self.ranks = [
            actor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": dict(env_vars or {})},
            ).remote()
            for i in range(self.num_ranks)
        ]
        master = ray.get(self.ranks[0].address.remote())
        kwargs = dict(seed=seed, zero_stage=zero_stage, gradient_checkpointing=gradient_checkpointing,
                      micro_batch_tokens=micro_batch_tokens, context_parallel_size=cp)
        # the ranks load the model while the caller goes on (e.g. starts the rollout workers); the first call waits
        self._starting = [r.start.remote(i, self.num_ranks, master, str(model_dir), cfg, kwargs, learner_cls)
                          for i, r in enumerate(self.ranks)]
        self.layouts: list[str] = []

    # -- calls ------------------------------------------------------------------------------------------------
    @staticmethod
    def _all(refs: list[Any]) -> list[Any]:
        """Every rank's result; the first failure is raised as soon as it happens."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])
        return ray.get(refs)

    def _started(self) -> None:
        if self._starting is not None:
            refs, self._starting = self._starting, None
            self.layouts = self._all(refs)

    def submit_per_rank(self, method: str, args_per_rank: list[tuple], kwargs: dict[str, Any] | None = None) -> Any:
        """``method(*args_per_rank[i], **kwargs)`` on rank i; an object ref to rank 0's result (module doc)."""
        import ray

        if not self.ranks:
            raise RuntimeError("the learner group is shut down")
        self._started()
        shared: dict[int, Any] = {}

        def put(a: Any) -> Any:  # the same large argument goes into the object store once for all ranks
            if not _large(a):
                return a
            if id(a) not in shared:
                shared[id(a)] = ray.put(a)
            return shared[id(a)]

        refs = [r.call.remote(method, *(put(a) for a in args), **(kwargs or {}))
                for r, args in zip(self.ranks, args_per_rank)]
        self._others = refs[1:]  # their results equal rank 0's; a failing rank takes rank 0 down (LearnerRank.call)
        return refs[0]

    def submit(self, method: str, *args, **kwargs) -> Any:
        return self.submit_per_rank(method, [args] * len(self.ranks), kwargs)

    def call(self, method: str, *args, **kwargs) -> Any:
        """The blocking form: rank 0's result."""
        self._started()
        return self._all([r.call.remote(method, *args, **kwargs) for r in self.ranks])[0]

    def call_all(self, method: str, *args, **kwargs) -> list[Any]:
        """Every rank's result, in rank order (e.g. ``state_bytes``)."""
        return self.call_all_per_rank(method, [args] * len(self.ranks), kwargs)

    def call_all_per_rank(self, method: str, args_per_rank: list[tuple], kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method(*args_per_rank[i], **kwargs)`` on rank i; every rank's result, in rank order."""
        self._started()
        return self._all([r.call.remote(method, *args, **(kwargs or {})) for r, args in zip(self.ranks, args_per_rank)])

    def __getattr__(self, name: str) -> "_Method":
        if name.startswith("_") or name not in _METHODS:
            raise AttributeError(name)
        return _Method(self, name)

    @property
    def sync_weights(self) -> "_Method":
        """``sync_weights.remote(workers, version)``: stream the weights to rollout worker actors
        (``learner.weight_sync``): rank 0 sends, every rank takes part in the ZeRO-3 gathers, the driver passes
        only actor handles. Resolves to rank 0's statistics (``SyncStats.as_dict``)."""
        group = self

        class _Sync(_Method):
            def remote(self, workers: list[Any], version: int, **kwargs) -> Any:
                args = [(list(workers) if i == 0 else None, version) for i in range(len(group.ranks))]
                return group.submit_per_rank("stream_weights", args, kwargs)

        return _Sync(self, "stream_weights")

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


# the Learner methods a group forwards (``group.<name>.remote(...)``)
_METHODS = frozenset({"train_rl", "train_sft", "sequence_logprobs", "snapshot_reference", "router_stats",
                      "save_checkpoint", "load_checkpoint", "export_hf", "get_weights", "state_bytes",
                      "stream_weights"})


class _Method:
    def __init__(self, group: LearnerGroup, name: str) -> None:
        self.group, self.name = group, name

    def remote(self, *args, **kwargs) -> Any:
        return self.group.submit(self.name, *args, **kwargs)


def _large(value: Any) -> bool:
    """Arguments put once into the object store instead of once per rank (lists of samples)."""
    return isinstance(value, (list, tuple, dict)) and len(value) > 8
