"""Reward configs: the default file, scoring, custom terms, and one clear error per broken file."""

from __future__ import annotations

import textwrap

import pytest

from rewards import DEFAULT_PATH, RewardConfigError, RewardTermError, load_reward_config

CUSTOM = '''
def bonus(info, num_model_tokens, num_turns, scale=1.0):
    return scale * info.get("tool_calls", 0)

def broken(info, num_model_tokens, num_turns):
    return "lots"

NOT_CALLABLE = 3
'''


@pytest.fixture
def write(tmp_path, monkeypatch):
    (tmp_path / "my_terms.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))

    def _write(text: str, name: str = "reward.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return _write


def test_default_config_is_package_data_and_scores():
    assert DEFAULT_PATH.name == "default.yaml" and DEFAULT_PATH.parent.name == "rewards"
    config = load_reward_config()
    assert set(config.terms) == {"success", "format"}
    total, terms = config.score({"success": True, "format_errors": 0}, num_model_tokens=40, num_turns=2)
    assert (total, terms) == (1.0, {"success": 1.0, "format": 0.0})
    total, terms = config.score({"success": False, "format_errors": 9}, num_model_tokens=40, num_turns=2)
    assert terms == {"success": 0.0, "format": pytest.approx(-0.2)} and total == pytest.approx(-0.2)  # capped at 4


def test_all_terms_compose(write):
    path = write("""
        description: everything
        terms:
          success: {weight: 2}
          format: {weight: 0.5}
          turn_penalty: {weight: 0.1, params: {free_turns: 2}}
          length_penalty: {weight: 0.001}
          tools_used: {weight: 1.0, function: "my_terms:bonus", params: {scale: 0.25}}
    """)
    total, terms = load_reward_config(path).score({"success": True, "format_errors": 1, "tool_calls": 4}, 300, 5)
    assert terms == pytest.approx({"success": 2.0, "format": -0.5, "turn_penalty": -0.3, "length_penalty": -0.3, "tools_used": 1.0})
    assert total == pytest.approx(sum(terms.values()))


def test_success_needs_a_finished_episode():
    with pytest.raises(ValueError, match="no bool 'success'"):
        load_reward_config().score({"turns": 1}, 1, 1)


@pytest.mark.parametrize(
    "text, key, problem",
    [
        ("description: x\n", "terms", "missing required key"),
        ("terms:\n  success: {}\n", "terms.success.weight", "missing required key"),
        ("terms:\n  success: {weight: high}\n", "terms.success.weight", "valid number (got 'high')"),
        ("terms:\n  success: {weight: 1, wieght: 2}\n", "terms.success.wieght", "unknown key; allowed keys: weight, function, params"),
        ("terms: []\n", "terms", "valid dictionary"),
        ("terms: {}\n", "terms", "at least 1 item"),
        ("term: {success: {weight: 1}}\n", "term", "unknown key; allowed keys: terms, description"),
        ("terms:\n  sucess: {weight: 1}\n", "terms.sucess", "unknown term 'sucess'; built-in terms: success, format"),
        ("terms:\n  format: {weight: 1, params: {cap: -1}}\n", "terms.format.params.cap", "greater than or equal to 0"),
        ("terms:\n  success: {weight: 1, params: {a: 1}}\n", "terms.success.params.a", "allowed keys: (none)"),
        ("terms:\n  success: {weight: 1, function: 'my_terms:bonus'}\n", "terms.success.function", "is a built-in term"),
        ("terms:\n  x: {weight: 1, function: 'no_such_module:f'}\n", "terms.x.function", "cannot import module 'no_such_module'"),
        ("terms:\n  x: {weight: 1, function: 'my_terms'}\n", "terms.x.function", "expected 'module:function'"),
        ("terms:\n  x: {weight: 1, function: 'my_terms:missing'}\n", "terms.x.function", "has no attribute 'missing'"),
        ("terms:\n  x: {weight: 1, function: 'my_terms:NOT_CALLABLE'}\n", "terms.x.function", "is not callable (int)"),
        ("terms:\n  x: {weight: 1, function: 'my_terms:bonus', params: {sclae: 2}}\n", "terms.x.params", "unexpected keyword argument 'sclae'"),
    ],
)
def test_broken_files_give_one_clear_error(write, text, key, problem):
    path = write(text)
    with pytest.raises(RewardConfigError) as e:
        load_reward_config(path)
    assert e.value.source == str(path) and e.value.key == key and problem in e.value.problem
    assert str(e.value).startswith(f"{path}: {key}: ")


@pytest.mark.parametrize(
    "text, problem",
    [
        ("terms: [unclosed\n", "invalid YAML at line 2"),
        ("- 1\n- 2\n", "expected a mapping with key 'terms', got list"),
        ("", "expected a mapping with key 'terms', got NoneType"),
    ],
)
def test_unreadable_files(write, text, problem):
    path = write(text)
    with pytest.raises(RewardConfigError, match=problem) as e:
        load_reward_config(path)
    assert str(e.value).startswith(str(path))
    with pytest.raises(RewardConfigError, match="cannot read file"):
        load_reward_config(path.parent / "missing.yaml")


def test_custom_term_must_return_a_number(write):
    config = load_reward_config(write("terms:\n  x: {weight: 1, function: 'my_terms:broken'}\n"))
    with pytest.raises(RewardTermError, match="reward term 'x' returned 'lots'"):
        config.score({"success": True}, 1, 1)
