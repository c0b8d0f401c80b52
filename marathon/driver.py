"""The training driver behind ``marathon train CONFIG``.

``prepare`` validates everything up front (config, env id and kwargs, reward file, model source) and raises
``ConfigError`` with one message before any work. ``Trainer.run`` then:

1. starts Ray (a local cluster, or the one ``ray job submit`` / ``RAY_ADDRESS`` points at), the learner actor
   (DeepSpeed) and the rollout worker actors (vLLM), per stage;
2. SFT warm start on oracle demos (first stage only, ``sft.steps`` > 0), with held-out evaluations before and
   after;
3. per RL step: rollout (``prompts_per_step`` tasks x ``group_size`` episodes; per-request sampling seeds
   derived from (run seed, step, episode)) -> rewards (reward config) -> group advantages -> learner update ->
   weight sync to the rollout workers;
4. at each stage end: held-out evaluation and the stage's gate; the next stage starts from the exported policy
   with its own RoPE base / context length / parallel settings.

Checkpoints (``marathon/checkpoint.py``: ``<output_dir>/checkpoints/ckpt-N``, linked as ``checkpoint``) hold
the learner (weights, optimizer, RNG), the driver state (phase, step, data position, policy version, RNG,
metrics so far) and the policy as an HF checkpoint; a save is atomic (a killed save leaves the previous
checkpoint), and a run started again with the same output dir resumes from the newest complete one and continues
the same trajectory (``metrics.csv`` is only ever appended to). An actor that dies (the learner mid-update, or a
rollout worker during a weight sync) restarts with the others from the last checkpoint, at most
``learner.max_restarts`` times. Env faults are data: an episode whose env raised or hung
(``info["infra_failure"]``, ``envs/guard.py``) or whose reward term failed is left out of its group's advantage
(the group is renormalised over the rest; ``episode_advantages``), counted per step (``infra_failures``) and
recorded with its traceback in ``infra_failures.jsonl``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs.schema import ConfigError, ModelSection, RunConfig, Stage, load_config, resolve_config_path
from marathon.checkpoint import CheckpointStore, fault_point

# Environment the learner actor needs (the rollout workers configure vLLM themselves).
PASS_ENV = ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")
SFT_SEED_START = 900_000_000  # SFT demo seeds: the top of the training range (RL draws from the bottom)


@dataclass
class Plan:
    """A validated run: everything ``Trainer`` needs, checked before any work."""

    cfg: RunConfig
    config_path: Path
    reward: Any  # rewards.RewardConfig
    stages: list[Stage]

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)


def _reward_path(cfg: RunConfig, config_path: Path) -> Path:
    p = Path(cfg.rewards)
    if p.is_absolute():
        return p
    import rewards

    for base in (config_path.parent, Path.cwd(), Path(rewards.__file__).resolve().parent.parent):
        if (base / p).is_file():
            return base / p
    return p


def _check_env(env_id: str, kwargs: dict[str, Any], where: str, timeout_s: float | None = None) -> None:
    """The env can be made with ``kwargs`` and reset (within ``timeout_s``); else one ``ConfigError``."""
    import envs
    from envs.guard import call_limited
    from envs.sandbox import SandboxUnavailable, env_uses_sandbox, require_kernel_boundary

    try:
        env = envs.make(env_id, **kwargs)
        if env_uses_sandbox(env):  # tool code needs the sandbox's kernel boundary (or env.sandbox: weak)
            require_kernel_boundary()
    except envs.UnknownEnvError as e:
        raise ConfigError(f"{where}: env.id: {e}") from None
    except SandboxUnavailable as e:  # also raised while making an env that loads untrusted tools in the sandbox
        raise ConfigError(f"{where}: env.sandbox: {e}") from None
    except Exception as e:  # noqa: BLE001 - an env's constructor may raise anything for options it cannot use
        if getattr(e, "config_key", None):  # the env names the key itself (envs/dataset.py: env.kwargs.data: ...)
            raise ConfigError(f"{where}: {e}") from None
        what = "" if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: "
        raise ConfigError(f"{where}: env.kwargs {kwargs}: {what}{e}") from None
    out = call_limited(env.reset, (), {"seed": 0}, timeout_s=timeout_s, name=f"{env_id}.reset")
    if not out.timed_out:  # a hung env is left to its thread
        call_limited(env.close, timeout_s=timeout_s)
    if out.timed_out:
        raise ConfigError(f"{where}: env.id: {env_id}: reset(seed=0) did not return within rollout.env_timeout_s = "
                          f"{timeout_s:g} s")
    if out.error is not None:
        raise ConfigError(f"{where}: env.id: {env_id}: reset(seed=0) with env.kwargs {kwargs} raised "
                          f"{type(out.error).__name__}: {out.error}")


def _check_model(m: ModelSection, where: str) -> None:
    if m.source == "path":
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f"{where}: model.path: {m.path} is not an HF checkpoint directory (no config.json)")
    elif m.source == "marathon":
        from model import PRESETS

        if m.preset not in PRESETS:
            raise ConfigError(f"{where}: model.preset: unknown preset {m.preset!r}; known: {sorted(PRESETS)}")
    elif m.overrides:
        raise ConfigError(f"{where}: model.overrides apply to source 'marathon' only (source is {m.source!r})")


def prepare(config_path: str | Path, overrides: dict[str, Any] | None = None, cluster: Any = None,
            check_layout: bool = True) -> Plan:
    """Load and validate a run; every problem is one ``ConfigError``. The stages' parallel layouts are checked
    against ``cluster`` (``marathon.plan.Cluster``; None: the cluster the run would use, ``detect_cluster``)."""
    path = resolve_config_path(config_path)
    cfg = load_config(path, overrides)
    from rewards import RewardConfigError, load_reward_config

    try:
        reward = load_reward_config(_reward_path(cfg, path))
    except RewardConfigError as e:
        raise ConfigError(f"{path}: rewards: {e}") from None
    stages = cfg.resolved_stages()
    from envs.sandbox import allow_weak

    allow_weak(cfg.env.sandbox == "weak")  # only the config opts into the sandbox's weaker mode
    for stage in stages:
        _check_env(cfg.env.id, stage.env_kwargs, f"{path} (stage {stage.name})" if cfg.stages else str(path),
                   cfg.rollout.env_timeout_s)
    if cfg.sft.steps:  # SFT demos need an oracle (dataset envs: reference solutions in the rows)
        from marathon.demos import sft_problem

        problem = sft_problem(cfg.env.id, stages[0].env_kwargs)
        if problem:
            raise ConfigError(f"{path}: sft.steps: {problem}")
    _check_model(cfg.model, str(path))
    if check_layout:  # every parallel setting takes effect or the run is refused here (marathon/plan.py)
        from marathon.plan import detect_cluster, layout_problems, model_config

        needs_model = any(s.rollout_tensor_parallel_size > 1 or s.context_parallel_size > 1 for s in stages)
        problems = layout_problems(cfg, stages, cluster or detect_cluster(), model_config(cfg) if needs_model else None,
                                   str(path))
        if problems:
            raise ConfigError(problems[0])
    return Plan(cfg, path, reward, stages)


# -- models ---------------------------------------------------------------------------------------------------
def init_model(m: ModelSection, path: Path) -> Path:
    """The run's initial HF checkpoint (tokenizer files next to it)."""
    if m.source == "path":
        return Path(m.path)
    if m.source == "tiny-qwen3":
        from marathon.tiny import write_tiny_qwen3

        return write_tiny_qwen3(path, seed=m.init_seed, vocab_size=m.vocab_size)
    from model.random_init import random_model

    random_model(path, m.preset, m.init_seed, m.vocab_size, **m.overrides).save_pretrained(path)
    return path


def rope_overrides(model_dir: Path, stage: Stage) -> dict[str, Any]:
    """Config changes a stage makes: RoPE base (both config styles) and a long enough position limit."""
    from transformers import AutoConfig

    import model  # noqa: F401  (registers the marathon config)

    cfg = AutoConfig.from_pretrained(str(model_dir))
    out: dict[str, Any] = {}
    if stage.rope_theta is not None:
        rope = getattr(cfg, "rope_parameters", None)
        if isinstance(rope, dict):
            out["rope_parameters"] = {**rope, "rope_theta": stage.rope_theta}
        else:
            out["rope_theta"] = stage.rope_theta
    if getattr(cfg, "max_position_embeddings", stage.max_episode_tokens) < stage.max_episode_tokens:
        out["max_position_embeddings"] = stage.max_episode_tokens
    return out


def stage_model(model_dir: Path, stage: Stage, out: Path) -> Path:
    """``model_dir`` with ``stage``'s config changes (`rope_overrides`): itself when there are none, else a
    checkpoint dir at ``out`` whose files link to ``model_dir``'s (weights are not copied) but whose config.json
    has the changes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    overrides = {k: v for k, v in rope_overrides(model_dir, stage).items() if getattr(config, k, None) != v}
    if not overrides:
        return model_dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    for k, v in overrides.items():
        setattr(config, k, v)
    config.save_pretrained(str(out))
    return out


def _engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    n = cfg.rollout.max_num_batched_tokens
    out: dict[str, Any] = {"max_num_batched_tokens": n} if n else {}
    if cfg.rollout.exact_linear_decode:  # read by the vLLM plugin (rollout/vllm_plugin/linear_attention.py)
        out["hf_overrides"] = {"linear_exact_decode": True}
    return out


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (run seed, step, episode): reproducible, well mixed."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] % 2**31)


def start_ray() -> None:
    """Connect to the cluster ``RAY_ADDRESS`` names (set by ``ray job submit``), else start a local one.
    Actor logs reach the driver only with ``MARATHON_RAY_LOGS=1``."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level="WARNING",
                 log_to_driver=os.environ.get("MARATHON_RAY_LOGS", "0") == "1")


# -- state ----------------------------------------------------------------------------------------------------
@dataclass
class RunState:
    step: int = 0  # rows logged: SFT steps then RL steps, over all stages
    sft_step: int = 0
    stage_index: int = 0
    stage_step: int = 0
    data_pos: int = 0  # tasks consumed by RL so far
    version: int = 0  # policy version served by the rollout workers
    stage_model: str = ""  # HF checkpoint the current stage's actors start from
    learner_ckpt: bool = False  # the checkpoint holds a learner state for this stage
    evals: dict[str, dict] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    finished: bool = False


class GateFailed(RuntimeError):
    pass


class RunAborted(RuntimeError):
    """The run cannot go on: actors kept dying (``learner.max_restarts``) or every episode keeps failing
    (``rollout.max_failed_steps``). The last checkpoint stays; a later start resumes from it."""


# -- evaluation -----------------------------------------------------------------------------------------------
def evaluate(pool: Any, codec: Any, env_id: str, env_kwargs: dict, seeds: list[int], max_new_tokens: int,
             max_context: int, temperature: float, sampling_seed: int = 0,
             env_timeout_s: float | None = 60.0) -> dict[str, Any]:
    """Success rate on ``seeds`` (held-out ones for evaluation) with the policy the pool serves; episodes whose
    env failed (``infra_failures``) are left out of it."""
    from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig

    runner = EpisodeRunner(pool, codec, RolloutConfig(max_new_tokens=max_new_tokens, max_context=max_context,
                                                      temperature=temperature, env_timeout_s=env_timeout_s))
    specs = [
        EpisodeSpec(f"eval-{s}", env_id, s, env_kwargs, None if temperature == 0 else derive_seed(sampling_seed, s))
        for s in seeds
    ]
    trajs = runner.run(specs)
    ok = [t for t in trajs if _failure(t) is None]
    wins = [t.success for t in ok]
    return {"success": sum(wins) / len(wins) if wins else float("nan"), "episodes": len(wins),
            "seeds": [seeds[0], seeds[-1]], "infra_failures": len(trajs) - len(ok),
            "mean_tokens": _mean([len(t.token_ids) for t in ok])}


# -- rewards and advantages (also for other rollout loops) ----------------------------------------------------
def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _failure(t: Any) -> dict[str, Any] | None:
    """The episode's infra failure (the runner's, or one its env reported), or None."""
    return t.info.get("infra_failure") or t.info.get("env", {}).get("infra_failure")


def score_episodes(trajs: list[Any], reward: Any) -> list[float | None]:
    """Reward each finished episode (sets ``t.reward``, ``t.reward_terms``); None for an infra-failed one. A
    reward term that raises or returns NaN/inf marks its episode as an infra failure (kind ``reward``,
    naming the term) instead of stopping the run."""
    from envs.guard import failure_info
    from rewards import RewardTermError

    out: list[float | None] = []
    for t in trajs:
        if _failure(t) is None:
            # an episode cut off by its context never got a final env step: it did not succeed
            info = {**t.info["env"], "success": bool(t.info["env"].get("success", False))}
            try:
                t.reward, t.reward_terms = reward.score(info, t.num_model_tokens, t.num_turns)
            except RewardTermError as e:
                t.info["infra_failure"] = failure_info("reward", "score", f"episode {t.episode_id}: {e}", e.traceback)
        out.append(None if _failure(t) else t.reward)
    return out


def episode_advantages(rewards: list[float | None], group_size: int, loss: Any) -> list[float | None]:
    """Group-relative advantages (``loss.advantage``: GRPO / RLOO), groups of ``group_size`` consecutive
    episodes. An infra-failed episode (reward None) is left out and its group renormalised over the members
    that remain (mean, std / leave-one-out over them); a group with fewer than two left gets None throughout
    (no baseline: dropped). A group without failures gets exactly ``group_advantages``' values."""
    from learner.losses import group_advantages

    out: list[float | None] = [None] * len(rewards)
    for start in range(0, len(rewards), group_size):
        idx = [i for i in range(start, min(start + group_size, len(rewards))) if rewards[i] is not None]
        if len(idx) >= 2:
            adv = group_advantages(torch.tensor([rewards[i] for i in idx]), len(idx), loss.advantage,
                                   loss.grpo_scale_std)
            for i, a in zip(idx, adv.tolist()):
                out[i] = a
    return out


# -- the trainer ----------------------------------------------------------------------------------------------
class Trainer:
    learner_cls: type | None = None  # the learner actor's class (None: learner.engine.Learner); tests inject faults

    def __init__(self, plan: Plan, resume: bool = True, progress: bool = True, log=print) -> None:
        self.plan, self.cfg = plan, plan.cfg
        self.resume, self.progress, self.log = resume, progress, log
        self.out = plan.out
        self.store = CheckpointStore(self.out)
        self.ckpt: Path | None = None  # the checkpoint resumed from / last saved
        self.restarts = 0  # actor restarts from a checkpoint in this process
        self.failed_steps = 0  # RL steps in a row whose every episode was an infra failure
        self.learner = None
        self.pool = None
        self.metrics = None
        self.bar = None

    # -- set-up -----------------------------------------------------------------------------------------------
    def _load_state(self) -> RunState:
        if not self.resume:
            if self.out.exists() and any(self.out.iterdir()):
                if not (self.out / "config.yaml").is_file():  # only ever delete what a run wrote
                    raise ConfigError(f"output_dir {self.out} is not empty and holds no marathon run; not deleting it")
                shutil.rmtree(self.out)
            return RunState()
        return self._read_checkpoint() or RunState()

    def _read_checkpoint(self) -> RunState | None:
        """The state of the newest complete checkpoint that loads (driver RNG restored), or None."""
        for ckpt in self.store.complete():
            try:
                blob = torch.load(ckpt / "driver.pt", weights_only=False)
            except Exception as e:  # noqa: BLE001 - an older complete checkpoint may still do
                self.log(f"warning: cannot read checkpoint {ckpt} ({type(e).__name__}: {e}); trying an older one")
                continue
            # both as JSON: the saved copy went through JSON (a YAML mapping's int keys became strings)
            ours = self.cfg.model_dump(mode="json", exclude={"steps"})
            theirs = RunConfig.model_validate(blob["config"]).model_dump(mode="json", exclude={"steps"})
            if ours != theirs:
                raise ConfigError(f"{self.out} holds a run with a different config; use another output_dir, or "
                                  "--fresh to start over")
            random.setstate(blob["rng"]["python"])
            np.random.set_state(blob["rng"]["numpy"])
            torch.set_rng_state(blob["rng"]["torch"])
            self.ckpt = ckpt
            return RunState(**blob["state"])
        return None

    def _start_actors(self, stage: Stage, model_dir: str) -> None:
        import ray
        from transformers import AutoTokenizer

        from learner.group import LearnerGroup
        from rollout.chat import ChatCodec
        from rollout.runner import WorkerPool
        from rollout.worker import WorkerConfig, spawn_worker

        cfg = self.cfg
        env_vars = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        # num_learner_ranks DeepSpeed ranks (DP x CP), one placement-group bundle each (learner/group.py)
        self.learner = LearnerGroup(model_dir, cfg.learner, cfg.seed, stage.zero_stage, stage.gradient_checkpointing,
                                    stage.micro_batch_tokens, stage.num_learner_ranks, stage.context_parallel_size,
                                    env_vars=env_vars, learner_cls=self.learner_cls)
        wcfg = WorkerConfig(
            model=model_dir, dtype="bfloat16" if cfg.learner.dtype == "bfloat16" else "float32",
            max_model_len=stage.max_episode_tokens, seed=cfg.seed, kv_cache_gib=cfg.rollout.kv_cache_gib,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            tensor_parallel_size=stage.rollout_tensor_parallel_size,
            enable_prefix_caching=cfg.rollout.prefix_caching,
            engine_kwargs=_engine_kwargs(cfg),
        )
        from rollout.async_worker import AsyncRolloutWorker
        from rollout.worker import RolloutWorker

        worker_cls = AsyncRolloutWorker if cfg.rollout.mode == "async" else RolloutWorker  # async: vLLM's AsyncLLM
        workers = [
            spawn_worker(wcfg, cls=worker_cls, num_cpus=cfg.rollout.num_cpus_per_worker,
                         num_gpus=cfg.rollout.num_gpus_per_worker)
            for _ in range(stage.num_rollout_workers)
        ]
        ready = ray.get([w.ready.remote() for w in workers])
        ray.get(self.learner.router_stats.remote())  # the learner is up
        if not all(r.get("seeded", True) for r in ready):
            self.log("warning: the rollout workers ignore per-request sampling seeds (vLLM on CPU cannot honour them "
                     "for hybrid models, async engines, or with chunked prefill: raise rollout.max_num_batched_tokens "
                     "for the latter): rollouts, and so resumed runs, are not reproducible")
        self.pool = WorkerPool(workers)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.codec = ChatCodec(self.tokenizer)

    def _stop_actors(self) -> None:
        import ray

        if self.learner is not None:
            self.learner.shutdown()
        for actor in self.pool.workers if self.pool else []:
            ray.kill(actor)
        self.learner = self.pool = None

    def _sync(self, state: RunState) -> float:
        import ray

        t0 = time.perf_counter()
        if all(hasattr(w, "begin_weight_update") for w in self.pool.workers):
            # streamed: bf16 buckets from learner rank 0 straight to the workers (learner/weight_sync.py)
            ray.get(self.learner.sync_weights.remote(self.pool.workers, state.version))
            self.pool.version, self.pool._weights_ref = state.version, None
            self.pool.resend = lambda worker, version: ray.get(self.learner.sync_weights.remote([worker], version))
        else:  # workers without the streamed path: the whole state dict through the driver
            self.pool.update_weights(ray.get(self.learner.get_weights.remote()), state.version)
        return time.perf_counter() - t0

    # -- checkpoints --------------------------------------------------------------------------------------------
    def _save(self, state: RunState, with_learner: bool = True) -> None:
        """A new checkpoint, atomically (``marathon/checkpoint.py``); the previous one stays until it is complete."""
        import ray

        state.learner_ckpt = with_learner
        self.metrics.flush()  # every row the checkpoint holds is on file first
        state.rows = list(self.metrics.rows)
        blob = {
            "config": self.cfg.model_dump(mode="json"),
            "state": asdict(state),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }

        def write(tmp: Path) -> None:
            if with_learner:
                ray.get(self.learner.save_checkpoint.remote(str(tmp / "learner"), {"step": state.step}))
                fault_point("learner")
                self._export(tmp / "policy")
                fault_point("policy")
            torch.save(blob, tmp / "driver.pt")

        self.ckpt = self.store.save(write)

    def _export(self, path: Path, overrides: dict[str, Any] | None = None) -> Path:
        import ray

        ray.get(self.learner.export_hf.remote(str(path), overrides))
        self.tokenizer.save_pretrained(str(path))
        return path

    # -- phases -------------------------------------------------------------------------------------------------
    def _eval(self, state: RunState, name: str, stage: Stage) -> dict[str, Any]:
        from envs import heldout_seeds

        e = self.cfg.eval
        t0 = time.perf_counter()
        res = evaluate(self.pool, self.codec, self.cfg.env.id, stage.env_kwargs, heldout_seeds(e.num_seeds),
                       stage.max_new_tokens_per_turn, stage.max_episode_tokens, e.temperature, self.cfg.seed,
                       self.cfg.rollout.env_timeout_s)
        res["step"], res["seconds"] = state.step, round(time.perf_counter() - t0, 2)
        res["wall_s"] = round(time.perf_counter() - self.t_start, 1)  # since this process started the run
        state.evals[name] = res
        self._write("evals.json", state.evals)
        failed = f", {res['infra_failures']} infra failures left out" if res["infra_failures"] else ""
        self._say(f"[eval {name}] step {state.step}: held-out success {res['success']:.3f} "
                  f"({res['episodes']} seeds {res['seeds'][0]}..{res['seeds'][1]}{failed}, {res['seconds']}s)")
        return res

    def _sft(self, state: RunState, stage: Stage) -> None:
        import ray

        from envs import train_seeds
        from learner.packing import Sample
        from marathon.demos import build_demos

        s = self.cfg.sft
        demos = build_demos(self.cfg.env.id, stage.env_kwargs, train_seeds(s.num_demos, SFT_SEED_START),
                            self.codec, stage.max_episode_tokens)
        order = np.random.default_rng(derive_seed(self.cfg.seed, 1)).permutation(len(demos) * (
            1 + s.steps * s.batch_size // len(demos)))  % len(demos)
        while state.sft_step < s.steps:
            t0 = time.perf_counter()
            idx = order[state.sft_step * s.batch_size : (state.sft_step + 1) * s.batch_size].tolist()
            batch = demos.select(idx)
            samples = [Sample(r["token_ids"], r["loss_mask"], [0.0] * len(r["token_ids"])) for r in batch]
            stats = ray.get(self.learner.train_sft.remote(samples, s.lr))
            state.sft_step += 1
            self._row(state, {"phase": "sft", "stage": stage.name, "loss": stats["loss"],
                              "grad_norm": stats["grad_norm"], "tokens": stats["tokens"],
                              "time/update": time.perf_counter() - t0})
        state.version += 1
        self._sync(state)

    def _between_steps(self, state: RunState, stage: Stage) -> None:
        """After an RL step (sync or async): the periodic held-out evaluation and checkpoint."""
        every = self.cfg.eval.every
        if every and state.stage_step % every == 0 and state.stage_step < stage.steps:
            res = self._eval(state, f"{stage.name}@{state.stage_step}", stage)
            self.metrics.add_to_last({"eval/success": res["success"]})
        if state.stage_step % self.cfg.checkpoint_every == 0 and state.stage_step < stage.steps:
            self._save(state)

    def _rl_step(self, state: RunState, stage: Stage) -> None:
        import ray

        from envs import train_seeds
        from learner.packing import Sample
        from rollout.runner import EpisodeRunner, EpisodeSpec, RolloutConfig

        cfg, P, G = self.cfg, stage.prompts_per_step, stage.group_size
        t0 = time.perf_counter()
        seeds = train_seeds(P, start=cfg.seed * 10_000_000 + state.data_pos)
        specs = [
            EpisodeSpec(f"s{state.step}-t{j}-g{g}", cfg.env.id, seed, stage.env_kwargs,
                        derive_seed(cfg.seed, state.step, j * G + g))
            for j, seed in enumerate(seeds) for g in range(G)
        ]
        runner = EpisodeRunner(self.pool, self.codec, RolloutConfig(
            max_new_tokens=stage.max_new_tokens_per_turn, max_context=stage.max_episode_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, env_timeout_s=cfg.rollout.env_timeout_s))
        trajs = runner.run(specs)
        t1 = time.perf_counter()
        rewards = score_episodes(trajs, self.plan.reward)  # None: an infra failure, left out below
        adv = episode_advantages(rewards, G, cfg.learner.loss)
        # Groups whose episodes all scored the same carry no signal (advantage 0): left out of the update.
        samples = [Sample(t.token_ids, t.loss_mask, t.logprobs, float(a), t.routed_experts)
                   for t, a in zip(trajs, adv) if a]
        ok = [t for t, r in zip(trajs, rewards) if r is not None]
        failures = [(t, _failure(t)) for t, r in zip(trajs, rewards) if r is None]
        self._record_failures(state, failures)  # before the update: a step redone after a crash records them again
        stats: dict[str, float] = {}
        t2 = t3 = time.perf_counter()
        if samples:
            stats = ray.get(self.learner.train_rl.remote(samples, cfg.learner.optimizer.lr, cfg.rollout.temperature))
            t2 = time.perf_counter()
            state.version += 1
            self._sync(state)
            t3 = time.perf_counter()
        state.data_pos += P
        state.stage_step += 1
        # episode statistics are over the episodes that did not fail (infra_failures counts those)
        row = {
            "phase": "rl", "stage": stage.name,
            "reward_mean": _mean([t.reward for t in ok]), "success_rate": _mean([t.success for t in ok]),
            "episode_tokens": _mean([len(t.token_ids) for t in ok]),
            "model_tokens": _mean([t.num_model_tokens for t in ok]),
            "turns": _mean([t.num_turns for t in ok]),
            "truncated": _mean([t.truncated for t in ok]),
            "trained_episodes": len(samples), "version": state.version,
            "infra_failures": len(failures),
            **{f"infra_failures/{k}": n for k, n in Counter(f["kind"] for _, f in failures).items()},
            **{k: v for k, v in stats.items()},
            **{f"reward/{k}": _mean([t.reward_terms[k] for t in ok]) for k in self.plan.reward.terms},
            "time/rollout": t1 - t0, "time/update": t2 - t1, "time/sync": t3 - t2,
            "gen_tokens_per_s": sum(t.num_model_tokens for t in trajs) / max(t1 - t0, 1e-9),
        }
        row.update(ray.get(self.learner.router_stats.remote()))
        self._row(state, row)
        self.failed_steps = 0 if ok else self.failed_steps + 1
        if self.failed_steps >= cfg.rollout.max_failed_steps:
            (kind, msg), n = Counter((f["kind"], f["message"]) for _, f in failures).most_common(1)[0]
            raise RunAborted(f"every episode of the last {self.failed_steps} RL steps was an infra failure "
                             f"(rollout.max_failed_steps); the commonest, {n} of the last step's: {kind}: {msg} "
                             f"(all: {self.out / 'infra_failures.jsonl'})")

    def _record_failures(self, state: RunState, failures: list[tuple[Any, dict]]) -> None:
        """Append the step's infra failures, tracebacks included, to ``infra_failures.jsonl`` (a step redone after a
        resume records its failures again, with a higher ``attempt``)."""
        if not failures:
            return
        with (self.out / "infra_failures.jsonl").open("a") as f:
            for t, fail in failures:
                rec = {"step": state.step, "attempt": self.metrics.attempt, "episode_id": t.episode_id,
                       "env_id": t.env_id, "seed": t.seed, **fail}
                f.write(json.dumps(rec, default=str) + "\n")
        self._say(f"[step {state.step}] {len(failures)} episode(s) ended by infra failures, left out of the update; "
                  f"first: {failures[0][1]['kind']}: {failures[0][1]['message']}")

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def _row(self, state: RunState, row: dict[str, Any]) -> None:
        row = {"step": state.step, **row}
        state.step += 1
        if self.bar is not None:
            self.bar.update(1)
            shown = {k: f"{row[k]:.3g}" for k in ("reward_mean", "success_rate", "loss") if k in row}
            self.bar.set_postfix(phase=row["phase"], **shown)
        self.metrics.log(row)

    def _say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            self.log(msg)

    def _write(self, name: str, data: Any) -> None:
        (self.out / name).write_text(json.dumps(data, indent=2, default=str))

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        from marathon.metrics import MetricsLog

        cfg, stages = self.cfg, self.plan.stages
        state = self._load_state()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(self.plan.config_path.read_text())
        self.metrics = MetricsLog(self.out, state.rows)
        if state.finished:
            self._say(f"{self.out}: run already finished (step {state.step}); nothing to do")
            return self._summary(state)
        self.store.clean()  # saves a killed run left unfinished
        resumed = bool(state.stage_model)
        if not resumed:
            state.stage_model = str(init_model(cfg.model, self.out / "model_init"))
            # the first stage's own RoPE base / position limit (later stages get theirs at export)
            state.stage_model = str(stage_model(Path(state.stage_model), stages[0], self.out / "stages" / stages[0].name / "model"))
        first_model = state.stage_model if not resumed else None
        total = cfg.sft.steps + sum(s.steps for s in stages)
        self.bar = tqdm(total=total, initial=state.step, desc="marathon", unit="step", dynamic_ncols=True,
                        disable=not self.progress)
        if resumed:
            self._say(f"resuming {self.out} at step {state.step} (stage {stages[state.stage_index].name}, "
                      f"stage step {state.stage_step}, policy version {state.version})")
        self.t_start = time.perf_counter()
        from envs.sandbox import isolation

        self._say(isolation().summary)  # what confines tool code in this run
        start_ray()
        import ray

        try:
            while state.stage_index < len(stages):
                try:
                    self._run_stage(state, stages[state.stage_index], first=state.stage_index == 0)
                except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:  # an actor died / was
                    state = self._restart(e, first_model)  # killed by Ray's memory monitor
            state.finished = True
            final = self._export(self.out / "final")
            self._save(state, with_learner=False)
        finally:
            self.bar.close()
            self.metrics.plot()
            self.metrics.close()
            if self.learner is not None:
                self._stop_actors()
        summary = self._summary(state)
        summary.update(final_model=str(final), wall_s=round(time.perf_counter() - self.t_start, 1))
        self._write("summary.json", summary)
        return summary

    def _restart(self, error: Exception, first_model: str | None) -> RunState:
        """An actor died: stop the others and go back to the last checkpoint (the start of the run if there is
        none yet) within this process; the next ``_run_stage`` starts fresh actors from it. Steps after the
        checkpoint are redone (their rows appended again, a new ``attempt``)."""
        self.restarts += 1
        limit = self.cfg.learner.max_restarts
        first_line = (str(error).strip().splitlines() or [""])[0]
        if self.restarts > limit:
            raise RunAborted(f"an actor died ({type(error).__name__}: {first_line}) after {limit} restart(s) "
                             f"from the last checkpoint (learner.max_restarts); giving up") from error
        self._stop_actors()
        state = self._read_checkpoint()
        if state is None:
            if first_model is None:
                raise RunAborted(f"an actor died and {self.out} holds no complete checkpoint to restart from") from error
            state = RunState(stage_model=first_model)
        self.metrics.rewind(state.rows)
        if self.bar is not None:
            self.bar.n = state.step
            self.bar.refresh()
        self._say(f"an actor died ({type(error).__name__}: {first_line}); restart {self.restarts} of at most {limit}: "
                  f"back to step {state.step} ({self.ckpt or 'the start: no checkpoint yet'})")
        return state

    def _run_stage(self, state: RunState, stage: Stage, first: bool) -> None:
        import ray

        cfg = self.cfg
        self._start_actors(stage, state.stage_model)
        if state.learner_ckpt:  # resuming inside this stage
            ray.get(self.learner.load_checkpoint.remote(str(self.ckpt / "learner")))
            self._sync(state)
        if first and state.sft_step < cfg.sft.steps:
            if "init" not in state.evals:
                self._eval(state, "init", stage)
            self._sft(state, stage)
            self.metrics.add_to_last({"eval/success": self._eval(state, "sft", stage)["success"]})
            self._export(self.out / "sft")  # the warm-started policy, for comparisons (marathon eval)
            self._save(state)
        ray.get(self.learner.snapshot_reference.remote())
        if cfg.rollout.mode == "async":  # rollout and learner overlap (marathon/async_loop.py); then no sync steps
            from marathon.async_loop import AsyncSteps

            AsyncSteps(self, state, stage).run()
        while state.stage_step < stage.steps:
            self._rl_step(state, stage)
            self._between_steps(state, stage)
        res = self._eval(state, stage.name, stage)
        if self.metrics.rows:
            self.metrics.add_to_last({"eval/success": res["success"]})
        if stage.gate is not None:
            self._check_gate(state, stage, res)
        state.stage_index += 1
        if state.stage_index < len(self.plan.stages):
            nxt = self.plan.stages[state.stage_index]
            model_dir = self.out / "stages" / nxt.name / "model"
            self._export(model_dir, rope_overrides(Path(state.stage_model), nxt))
            state.stage_model, state.stage_step = str(model_dir), 0
            self._save(state, with_learner=False)
            self._stop_actors()

    def _check_gate(self, state: RunState, stage: Stage, eval_result: dict) -> None:
        gate = stage.gate
        if gate.metric == "heldout_success":
            value = eval_result["success"]
        else:
            key = "reward_mean" if gate.metric == "reward_mean" else "loss"
            vals = [r[key] for r in self.metrics.rows if r.get("stage") == stage.name and r.get("phase") == "rl"
                    and key in r][-10:]
            value = float(np.mean(vals)) if vals else float("nan")
        ok = not np.isnan(value) and (gate.min is None or value >= gate.min) and (gate.max is None or value <= gate.max)
        state.evals[f"gate:{stage.name}"] = {"metric": gate.metric, "value": value, "min": gate.min, "max": gate.max,
                                             "passed": bool(ok)}
        self._write("evals.json", state.evals)
        if not ok:
            self._save(state)
            raise GateFailed(f"stage {stage.name!r} gate failed: {gate.metric} = {value:.4g}, required "
                             f"[{gate.min}, {gate.max}]; the next stage does not start (checkpoint: {self.ckpt})")
        self._say(f"[gate {stage.name}] {gate.metric} = {value:.4g} passed")

    def _summary(self, state: RunState) -> dict[str, Any]:
        return {"output_dir": str(self.out), "step": state.step, "evals": state.evals, "actor_restarts": self.restarts,
                "metrics_csv": str(self.out / "metrics.csv"), "plot": str(self.out / "plot.png")}


def evaluate_checkpoint(plan: Plan, model_dir: str | Path, stage: Stage, num_seeds: int | None = None,
                        temperature: float | None = None) -> dict:
    """Held-out success of an HF checkpoint: one rollout worker, the config's evaluation settings."""
    import ray
    from transformers import AutoTokenizer

    from envs import heldout_seeds
    from rollout.chat import ChatCodec
    from rollout.runner import WorkerPool
    from rollout.worker import WorkerConfig, spawn_worker

    cfg = plan.cfg
    temp = cfg.eval.temperature if temperature is None else temperature
    t0 = time.perf_counter()
    start_ray()
    worker = spawn_worker(WorkerConfig(model=str(model_dir), dtype="float32", max_model_len=stage.max_episode_tokens,
                                       seed=cfg.seed, kv_cache_gib=cfg.rollout.kv_cache_gib,
                                       engine_kwargs=_engine_kwargs(cfg)),
                          num_cpus=cfg.rollout.num_cpus_per_worker, num_gpus=cfg.rollout.num_gpus_per_worker)
    try:
        ray.get(worker.ready.remote())
        codec = ChatCodec(AutoTokenizer.from_pretrained(str(model_dir)))
        res = evaluate(WorkerPool([worker]), codec, cfg.env.id, stage.env_kwargs,
                       heldout_seeds(num_seeds or cfg.eval.num_seeds), stage.max_new_tokens_per_turn,
                       stage.max_episode_tokens, temp, cfg.seed, cfg.rollout.env_timeout_s)
    finally:
        ray.kill(worker)
    return {"checkpoint": str(model_dir), "env": cfg.env.id, "stage": stage.name, **res,
            "temperature": temp, "wall_s": round(time.perf_counter() - t0, 1)}
