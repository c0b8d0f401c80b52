"""Run configs: shipped YAMLs validate; a malformed config, an unknown env id or a broken reward file stops
``marathon train`` before any work with one clear message."""

from pathlib import Path

import pytest
import yaml

from configs.schema import ConfigError, load_config
from marathon.cli import main
from marathon.driver import prepare

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _write(tmp_path, data, name="run.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def _tiny(tmp_path, **changes):
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def test_shipped_configs_validate():
    tiny = load_config(CONFIGS / "tiny.yaml")
    assert tiny.env.id == "marathon/Arithmetic-v0" and tiny.model.source == "marathon"
    assert load_config("configs/tiny.yaml") == tiny  # also found as package data from any directory
    staged = load_config(CONFIGS / "context_extension.yaml")
    stages = staged.resolved_stages()
    assert [s.max_episode_tokens for s in stages] == [8192, 65536, 262144, 1048576]
    assert all(s.gate is not None and s.rope_theta for s in stages)
    assert stages[1].zero_stage == 3 and stages[0].zero_stage == 3
    assert [(s.num_learner_ranks, s.context_parallel_size) for s in stages] == [(16, 1), (16, 1), (16, 4), (16, 8)]
    assert stages[2].env_kwargs["n_tokens"] == 256000 and stages[2].env_kwargs["max_turns"] == 24  # merged


def test_staged_config_passes_full_validation_with_a_local_model(tmp_path):
    # the shipped staged config points at a cluster checkpoint; with a tiny preset everything else validates on a
    # cluster with its resources (24 GPUs; tests/test_dry_run.py prints its plan)
    from marathon.plan import Cluster

    plan = prepare(CONFIGS / "context_extension.yaml", {"model.source": "marathon", "model.preset": "tiny"},
                   cluster=Cluster(24, 256, "a test cluster"))
    assert [s.name for s in plan.stages] == ["ctx8k", "ctx64k", "ctx256k", "ctx1m"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"learner.optimizer.lr": -1}, r"learner\.optimizer\.lr: Input should be greater than 0 \(got -1\)"),
        ({"rollout.group_sise": 4}, r"rollout\.group_sise: Extra inputs are not permitted"),
        ({"rollout.group_size": "many"}, r"rollout\.group_size: Input should be a valid integer"),
        ({"learner.loss.advantage": "ppo"}, r"learner\.loss\.advantage: Input should be 'grpo' or 'rloo'"),
        ({"learner.loss.ratio_mask": [2, 5]}, r"ratio_mask must be \(low, high\)"),
        ({"stages": [{"name": "a", "steps": 1, "max_episode_tokens": 64}]}, r"either top-level 'steps' or a 'stages'"),
    ],
)
def test_malformed_config_one_message(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        prepare(_write(tmp_path, _tiny(tmp_path, **changes)))
    assert "\n" not in str(e.value) and str(tmp_path / "run.yaml") in str(e.value)


def test_not_yaml_and_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        prepare(_write(tmp_path, "env: [unclosed"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        prepare(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="env: Field required"):
        prepare(_write(tmp_path, "seed: 1\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        prepare(tmp_path / "nope.yaml")


def test_unknown_env_id(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.id: .*marathon/Arithmetic-v9.*marathon/Arithmetic-v0"):
        prepare(_write(tmp_path, _tiny(tmp_path, **{"env.id": "marathon/Arithmetic-v9"})))


def test_bad_env_kwargs(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.kwargs .*difficulty"):
        prepare(_write(tmp_path, _tiny(tmp_path, **{"env.kwargs": {"difficulty": "impossible"}})))


def test_reward_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards: .*missing\.yaml.*cannot read file"):
        prepare(_write(tmp_path, _tiny(tmp_path, rewards=str(tmp_path / "missing.yaml"))))
    (tmp_path / "bad.yaml").write_text("terms:\n  success: {weight: high}\n")
    with pytest.raises(ConfigError, match=r"rewards: .*bad\.yaml.*weight"):
        prepare(_write(tmp_path, _tiny(tmp_path, rewards="bad.yaml")))  # relative to the config file


def test_cli_prints_one_line_and_does_no_work(tmp_path, capsys):
    cfg = _write(tmp_path, _tiny(tmp_path, **{"env.id": "nope/Env-v0"}))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nope/Env-v0" in err
    assert not (tmp_path / "run").exists()  # nothing was started or written
