"""Property test: random text (and random near-miss tool calls) thrown at ``step`` of every built-in env
never raises, never hangs, and always returns contract-shaped values."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs.parsing import format_call
from envs.episodes import step_problems

# env id -> (options, examples, per-example deadline in ms)
BUILTINS = {
    "marathon/Arithmetic-v0": ({"difficulty": "hard"}, 60, 2000),
    "marathon/Retrieval-v0": ({"difficulty": "medium"}, 60, 2000),
    # every schema-valid call starts a sandbox subprocess (~0.1 s; 1 s limit)
    "marathon/CodeSandbox-v0": ({"timeout_s": 1.0}, 25, 20000),
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
SNIPPETS = ["6 * 7", "1 / 0", "2 ** 0.5", "print(2 + 2)", "open('numbers.txt').read()", "vault code", "Final answer: 3"]


def schema_calls(tools: list[dict]) -> st.SearchStrategy[str]:
    """Calls that match a tool's argument schema (so the tool itself runs), with random values."""
    def args(params: dict) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries({
            k: st.integers(-10, 3000) if v.get("type") == "integer" else st.text(max_size=30) | st.sampled_from(SNIPPETS)
            for k, v in params.get("properties", {}).items()
        })

    return st.one_of([
        st.builds(lambda a, name=t["function"]["name"]: format_call(name, a), args(t["function"]["parameters"]))
        for t in tools
    ])


def turns(tools: list[dict]) -> st.SearchStrategy[str]:
    wrapped_noise = st.text(max_size=30).map(lambda t: f"<tool_call>{t}</tool_call>")
    piece = st.text(max_size=60) | st.text(st.characters(categories=["Cs"]), max_size=2) | st.sampled_from(TAGS) | wrapped_noise | near_miss_calls | schema_calls(tools)
    return st.lists(piece, max_size=8).map("".join)


@pytest.mark.parametrize("env_id", list(BUILTINS))
def test_random_text_never_breaks_step(env_id):
    options, examples, deadline_ms = BUILTINS[env_id]
    env = envs.make(env_id, **options)
    kinds_seen: set[str] = set()

    @settings(max_examples=examples, deadline=deadline_ms, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 1000), actions=st.lists(turns(env.reset(seed=0)[0]["tools"]), min_size=1, max_size=4))
    def run(seed, actions):
        env.reset(seed=seed)
        for action in actions:
            result = env.step(action)
            assert not step_problems(result), step_problems(result)
            obs, _, terminated, truncated, info = result
            assert all(m["role"] == "tool" and m["content"] and m["content"].encode("utf-8") for m in obs["messages"])
            kinds_seen.update(info["call_kinds"])
            if terminated or truncated:
                assert isinstance(info["success"], bool)
                break

    run()
    env.close()
    # the fuzzing reached the parser's error paths and the tools themselves
    assert {"malformed", "unknown_tool", "bad_arguments"} <= kinds_seen, kinds_seen
    assert kinds_seen & {"ok", "tool_error", "timeout"}, kinds_seen
