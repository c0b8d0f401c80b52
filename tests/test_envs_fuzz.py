"""Property test: random text (and random near-miss tool calls) thrown at ``step`` of every built-in env
never raises, never hangs, and always returns contract-shaped values."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.episodes import step_problems

BUILTINS = {
    "marathon/Arithmetic-v0": {"difficulty": "hard"},
    "marathon/Retrieval-v0": {"difficulty": "medium"},
    # tiny limits: a fuzzed call that happens to be valid Python must still finish quickly
    "marathon/CodeSandbox-v0": {"timeout_s": 1.0},
}
TAGS = ["<tool_call>", "</tool_call>", "Final answer:", "{", "}", '"name"', '"arguments"', ":", ",", "\n"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
near_miss_calls = st.builds(
    lambda name, args: f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>",
    st.sampled_from(["calculator", "search", "read", "run_python", "nope", ""]),
    st.dictionaries(st.sampled_from(["expression", "query", "doc_id", "offset", "code", "x"]), json_values, max_size=3),
)
turns = st.lists(st.text(max_size=60) | st.sampled_from(TAGS) | near_miss_calls, max_size=8).map("".join)


@pytest.mark.parametrize("env_id", list(BUILTINS))
def test_random_text_never_breaks_step(env_id):
    env = envs.make(env_id, **BUILTINS[env_id])

    @settings(max_examples=60, deadline=3000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 1000), actions=st.lists(turns, min_size=1, max_size=4))
    def run(seed, actions):
        env.reset(seed=seed)
        for action in actions:
            result = env.step(action)
            assert not step_problems(result), step_problems(result)
            obs, _, terminated, truncated, info = result
            assert all(m["role"] == "tool" and m["content"] for m in obs["messages"])
            if terminated or truncated:
                assert isinstance(info["success"], bool)
                break

    run()
    env.close()
