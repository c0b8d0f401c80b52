"""Every class of model mistake or tool failure becomes a tool observation, never an exception."""

from __future__ import annotations

import time

import pytest

import envs
from envs.base import ToolEnv
from envs.parsing import format_call
from envs.tools import Tool


class ProbeEnv(ToolEnv):
    """A minimal env whose tools fail on purpose."""

    def __init__(self, max_turns: int = 5) -> None:
        def boom(x: int) -> str:
            raise RuntimeError(f"boom {x}")

        def slow(seconds: float) -> str:
            time.sleep(seconds)
            return "slept"

        def echo(text: str) -> str:
            return text

        def bad_return() -> str:
            return 42  # type: ignore[return-value]

        obj = {"type": "object", "additionalProperties": False}
        super().__init__(
            [
                Tool("boom", "raises", {**obj, "properties": {"x": {"type": "integer"}}, "required": ["x"]}, boom),
                Tool("slow", "sleeps", {**obj, "properties": {"seconds": {"type": "number"}}}, slow, timeout_s=0.2),
                Tool("echo", "echoes", {**obj, "properties": {"text": {"type": "string"}}, "required": ["text"]}, echo),
                Tool("bad_return", "returns a non-str", {**obj, "properties": {}}, bad_return),
            ],
            max_turns=max_turns,
            max_calls_per_turn=3,
            max_observation_chars=100,
        )

    def _new_task(self, options):
        return [{"role": "user", "content": "say hi"}]

    def _is_correct(self, answer: str) -> bool:
        return answer == "hi"


def one_step(env: ToolEnv, action: str):
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert reward == 0.0 and not terminated and not truncated
    return obs["messages"], info


@pytest.mark.parametrize(
    "action, kind, text",
    [
        ("<tool_call>{not json}</tool_call>", "malformed", "malformed JSON"),
        ("<tool_call></tool_call>", "malformed", "empty"),
        ("<tool_call>[1, 2]</tool_call>", "malformed", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed", 'missing "name"'),
        ('<tool_call>{"name": 3}</tool_call>', "malformed", '"name" must be a string'),
        ('<tool_call>{"name": "echo", "arguments": [1]}</tool_call>', "malformed", '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "echo", "arguments": {"text": "a"}} trailing</tool_call>', "malformed", "unexpected text"),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown_tool", "unknown tool 'nope'"),
        ('<tool_call>{"name": "boom", "arguments": {"x": "1"}}</tool_call>', "bad_arguments", "'1' is not of type 'integer'"),
        ('<tool_call>{"name": "boom", "arguments": {}}</tool_call>', "bad_arguments", "'x' is a required property"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "a", "y": 1}}</tool_call>', "bad_arguments", "Additional properties"),
        ('<tool_call>{"name": "boom", "arguments": {"x": 7}}</tool_call>', "tool_error", "RuntimeError: boom 7"),
        ('<tool_call>{"name": "bad_return", "arguments": {}}</tool_call>', "tool_error", "returned int, not text"),
        ('<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>', "timeout", "timed out after 0.2 s"),
    ],
)
def test_each_error_becomes_an_observation(action, kind, text):
    messages, info = one_step(ProbeEnv(), action)
    assert info["call_kinds"] == [kind]
    assert len(messages) == 1 and messages[0]["role"] == "tool"
    assert messages[0]["content"].startswith("error:") and text in messages[0]["content"]
    counter = {"timeout": "tool_timeouts", "tool_error": "tool_errors"}.get(kind, "format_errors")
    assert info[counter] == 1 and info["tool_calls"] == 1


def test_lenient_forms_are_accepted():
    env = ProbeEnv()
    for action in [
        '<tool_call>\n  {"name": "echo", "arguments": {"text": "a"}}\n',  # no closing tag (stop string dropped)
        '<tool_call>```json\n{"name": "echo", "arguments": {"text": "a"}}\n```</tool_call>',
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"a\\"}"}</tool_call>',  # OpenAI-style string
    ]:
        messages, info = one_step(env, action)
        assert info["call_kinds"] == ["ok"] and messages == [{"role": "tool", "content": "a"}], action


def test_several_calls_per_turn_and_limit():
    env = ProbeEnv()
    call = format_call("echo", {"text": "x"})
    messages, info = one_step(env, "thinking... " + call + " and " + format_call("nope", {}) + call * 3)
    assert info["call_kinds"] == ["ok", "unknown_tool", "ok", "ignored"]
    assert [m["content"][:6] for m in messages] == ["x", "error:", "x", "error:"]
    assert "2 more tool call(s) ignored" in messages[-1]["content"]
    assert info["tool_calls"] == 5 and info["format_errors"] == 3


def test_tool_output_is_clipped_and_valid_utf8():
    messages, _ = one_step(ProbeEnv(), format_call("echo", {"text": "y" * 500}))
    assert messages[0]["content"].endswith("[truncated 400 characters]")
    messages, _ = one_step(ProbeEnv(), format_call("echo", {"text": "a\ud800b"}))
    assert messages[0]["content"] == "a?b"


def test_final_answer_and_truncation():
    env = ProbeEnv(max_turns=2)
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step("I think.\nFINAL  ANSWER =  hi  ")
    assert (obs, terminated, truncated, info["success"], info["format_errors"]) == ({"messages": []}, True, False, True, 0)
    env.reset(seed=0)
    *_, info = env.step("hi")  # no marker: taken as the answer, one format error
    assert info["success"] and info["format_errors"] == 1
    env.reset(seed=0)
    env.step(format_call("echo", {"text": "a"}))
    _, _, terminated, truncated, info = env.step(format_call("echo", {"text": "a"}))
    assert not terminated and truncated and info["success"] is False and info["turns"] == 2


def test_programming_errors_raise():
    env = ProbeEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("hi")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="must be the model's turn as str"):
        env.step(b"hi")  # type: ignore[arg-type]
    env.step("Final answer: hi")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("hi")


def test_builtin_tool_failures_become_observations():
    env = envs.make("marathon/Arithmetic-v0")
    env.reset(seed=0)
    obs, *_ = env.step(format_call("calculator", {"expression": "1 / 0"}) + format_call("calculator", {"expression": "__import__('os')"}))
    assert [m["content"] for m in obs["messages"]] == [
        "error: division by zero",
        "error: unknown function '__import__' (functions: abs, min, max, round, sqrt)",
    ]
    env = envs.make("marathon/Retrieval-v0")
    env.reset(seed=0)
    obs, *_, info = env.step(format_call("read", {"doc_id": 10**6}))
    assert obs["messages"][0]["content"].startswith("error: doc_id must be in 0..") and info["tool_errors"] == 1


def test_sandbox_timeout_and_crash_become_observations():
    env = envs.make("marathon/CodeSandbox-v0", timeout_s=1.0)
    env.reset(seed=0)
    obs, *_, info = env.step(format_call("run_python", {"code": "while True: pass"}))
    assert obs["messages"][0]["content"].startswith("error: run_python timed out after 1 s")
    assert info["call_kinds"] == ["timeout"] and info["tool_timeouts"] == 1
    obs, *_, info = env.step(format_call("run_python", {"code": "raise ValueError('bad input')"}))
    content = obs["messages"][0]["content"]
    assert content.startswith("exit code: 1") and "ValueError: bad input" in content and info["call_kinds"] == ["ok"]
    env.close()


@pytest.mark.parametrize(
    "action",
    [
        "<tool_call>" * 50_000,  # many unclosed blocks: linear-time scan
        "<tool_call>```" + " " * 200_000 + "x",  # a fence that never closes
        "<tool_call>" + "[" * 100_000,  # JSON nested too deep
        '<tool_call>{"name": "echo", "arguments": {"text": ' + "1" * 5000 + "}}",  # integer too long for Python
        '<tool_call>{"name": "echo", "arguments": "' + "[" * 100_000 + '"}',
        "final " * 100_000,
    ],
)
def test_adversarial_turns_are_fast_and_harmless(action):
    env = ProbeEnv()
    env.reset(seed=0)
    start = time.perf_counter()
    obs, _, terminated, truncated, info = env.step(action)
    assert time.perf_counter() - start < 2.0
    assert terminated or all(m["content"].startswith("error:") for m in obs["messages"])
