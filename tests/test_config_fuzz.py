"""Fuzzed configs (issue 15): run configs, ``--set`` overrides and reward YAML, mutated by hypothesis. Every input
either loads, or fails with ONE error of the documented type (``ConfigError`` / ``RewardConfigError``) whose
message names the file and the key (or the line, for YAML that does not parse): never another exception."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs.schema import ConfigError, load_config
from marathon.driver import prepare
from rewards import RewardConfigError, load_reward_config

ROOT = Path(__file__).resolve().parent.parent
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
REWARD = yaml.safe_load((ROOT / "rewards" / "default.yaml").read_text())
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**20), max_value=10**20) | st.floats()
           | st.text(max_size=12) | st.sampled_from(["", "0", "1e3", "nan", "-1", "\x00", "../..", "~"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=3), max_leaves=8)


def _paths(data, prefix=()):
    """Every key path of a nested mapping."""
    for k, v in data.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


KEYS = sorted(set(_paths(TINY)) | {("stages",), ("learner", "loss", "ratio_mask"), ("rollout", "env_timeout_s"),
                                   ("learner", "max_restarts"), ("eval", "every"), ("model", "path")})


@st.composite
def mutated(draw, base):
    """``base`` with 1-3 mutations: a key set to a random value, a key removed, an unknown key added."""
    data = copy.deepcopy(base)
    touched = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(KEYS))
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        kind = draw(st.sampled_from(["set", "set", "delete", "unknown"]))
        if kind == "set":
            node[path[-1]] = draw(values)
        elif kind == "delete":
            node.pop(path[-1], None)
        else:
            node[draw(st.text(min_size=1, max_size=6))] = draw(values)
        touched.append(path)
    return data, touched


def _dump(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def _names_file_and_key(msg: str, path: Path) -> None:
    assert msg.startswith(f"{path}: "), msg
    rest = msg[len(f"{path}: "):]
    # a key (dotted path, or "(top level)"), a YAML position, or the section of a cross-field check
    assert re.match(r"^(\(top level\)|[^\s:]+|not valid YAML.*line \d+|expected a mapping|rewards: |"
                    r"override |env\.|sft\.|model\.)", rest), msg


@FUZZ
@given(doc=mutated(TINY))
def test_run_configs_load_or_fail_with_one_config_error(tmp_path_factory, doc):
    data, _ = doc
    path = tmp_path_factory.mktemp("fuzz") / "run.yaml"
    path.write_text(_dump(data))
    try:
        load_config(path)
    except ConfigError as e:
        _names_file_and_key(str(e), path)


@settings(FUZZ, max_examples=60)
@given(doc=st.just(({**TINY, "sft": {"steps": 0}}, [])) | mutated({**TINY, "sft": {"steps": 0}}),
       kwargs=st.dictionaries(st.sampled_from(["difficulty", "max_turns", "operators", "max_operand", "nope", "seed"]),
                              scalars | st.lists(scalars, max_size=2), max_size=2))
def test_prepare_fails_with_one_config_error(tmp_path_factory, doc, kwargs):
    """Through everything ``marathon train`` checks before any work: env id and options (made and reset),
    reward file, model."""
    data, _ = copy.deepcopy(doc)
    if isinstance(data.get("env"), dict) and isinstance(data["env"].get("kwargs"), dict):
        data["env"]["kwargs"].update(kwargs)
    path = tmp_path_factory.mktemp("fuzz") / "run.yaml"
    path.write_text(_dump(data))
    (path.parent / "rewards").mkdir()
    (path.parent / "rewards" / "default.yaml").write_text(_dump(REWARD))
    try:
        prepare(path)
    except ConfigError as e:
        _names_file_and_key(str(e), path)


@FUZZ
@given(key=st.lists(st.sampled_from(["rollout", "learner", "loss", "seed", "steps", "x", "", "env", "kwargs"]),
                    min_size=1, max_size=4).map(".".join), value=values)
def test_set_overrides_fail_with_one_config_error(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("fuzz") / "run.yaml"
    path.write_text(_dump(TINY))
    try:
        load_config(path, {key: value})
    except ConfigError as e:
        _names_file_and_key(str(e), path)


@FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
       raw=st.binary(max_size=64))
def test_text_that_is_not_a_config(tmp_path_factory, text, raw):
    d = tmp_path_factory.mktemp("fuzz")
    for path, write in ((d / "a.yaml", lambda p: p.write_text(text)), (d / "b.yaml", lambda p: p.write_bytes(raw)),
                        (d / "r.yaml", lambda p: p.write_text(text))):
        write(path)
        try:
            (load_reward_config if path.name == "r.yaml" else load_config)(path)
        except (ConfigError, RewardConfigError) as e:
            assert str(e).startswith(f"{path}: "), str(e)


TERM_FUNCTIONS = ["rewards.terms:success", "rewards.terms:nope", "rewards.terms", "math:sqrt", ":", "a:b:c",
                  "no_such_module_xyz:f", "rewards.terms:BUILTIN_TERMS", "rewards.terms:format_errors"]


@st.composite
def reward_docs(draw):
    doc = copy.deepcopy(REWARD)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(["success", "format", "turn_penalty", "custom", "x"]) | st.text(max_size=6))
        term = doc["terms"].setdefault(name, {"weight": 1.0}) if isinstance(doc.get("terms"), dict) else {}
        term = term if isinstance(term, dict) else {}  # replaced by a non-mapping earlier: mutate a throwaway
        what = draw(st.sampled_from(["weight", "function", "params", "unknown", "term", "top"]))
        if what == "weight":
            term["weight"] = draw(values)
        elif what == "function":
            term["function"] = draw(st.sampled_from(TERM_FUNCTIONS) | values)
        elif what == "params":
            term["params"] = draw(st.dictionaries(st.sampled_from(["cap", "free_turns", "scale", "x"]), values,
                                                  max_size=2) | values)
        elif what == "unknown":
            term[draw(st.text(min_size=1, max_size=5))] = draw(values)
        elif what == "term" and isinstance(doc.get("terms"), dict):
            doc["terms"][name] = draw(values)
        else:
            doc[draw(st.sampled_from(["terms", "description", "extra"]))] = draw(values)
    return doc


@FUZZ
@given(doc=reward_docs())
def test_reward_configs_load_or_fail_with_one_reward_config_error(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fuzz") / "reward.yaml"
    path.write_text(_dump(doc))
    try:
        load_reward_config(path)
    except RewardConfigError as e:
        assert str(e).startswith(f"{path}: ") and e.source == str(path), str(e)
        assert e.key or "invalid YAML" in e.problem or "expected a mapping" in e.problem, str(e)


@pytest.mark.parametrize("text", ["[" * 1500 + "]" * 1500, "a: &x [*x]\n", "env: !!python/object/apply:os.system [ls]\n",
                                  "\ufeffseed: 1\n", "seed: 1\n\x00"])
def test_pathological_yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: ")


def test_non_finite_numbers_and_nul_paths_are_config_errors(tmp_path):
    for key, value in (("learner.optimizer.lr", float("inf")), ("rollout.temperature", float("nan")),
                       ("output_dir", "runs/\x00x"), ("rewards", "r\x00.yaml")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(ROOT / "configs" / "tiny.yaml", {key: value})
