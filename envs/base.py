"""The environment contract for multi-round tool-calling text agents, and ``ToolEnv``, its base class.

Contract (what rollout workers, the learner and ``marathon env check`` rely on):

- An environment is a ``gymnasium.Env`` registered in gymnasium's registry (ids like
  ``marathon/Arithmetic-v0``); ``envs.make(env_id, **kwargs)`` makes one (loading ``marathon.envs`` plugins
  first) and raises ``envs.UnknownEnvError`` naming the known ids for an unknown id.
- ``reset(seed=None, options=None) -> (obs, info)`` with
  ``obs = {"messages": [{"role": "system"|"user", "content": str}, ...], "tools": [tool, ...]}`` where each
  tool is an OpenAI function description ``{"type": "function", "function": {"name", "description",
  "parameters": <JSON schema>}}``. The same seed gives the same obs (the task is a function of the seed).
- ``step(action_text: str) -> (obs, reward, terminated, truncated, info)`` reads the model's whole turn
  (format in ``envs/parsing.py``). Tool calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (one or more per turn) run, and ``obs = {"messages": [{"role": "tool", "content": str}, ...]}``, one
  message per call, in order. A turn without a tool call is the final answer (``Final answer: X``); the
  episode terminates with ``obs = {"messages": []}``. ``truncated`` is True when ``max_turns`` turns were
  used without a final answer.
- ``reward`` is always 0.0: rewards are computed from ``info`` by ``rewards/``. ``info`` on every step has
  the running counters ``turns``, ``tool_calls``, ``format_errors``, ``tool_errors``, ``tool_timeouts`` and
  ``call_kinds`` (this turn's result per call: ok, malformed, unknown_tool, bad_arguments, tool_error,
  timeout, ignored); the last step of an episode adds ``success: bool`` and ``answer: str | None``.
- The model's mistakes never raise: malformed calls, unknown tools, bad arguments, tool exceptions and
  timeouts each come back as a ``tool`` message starting with ``error:``. Programming errors do raise:
  ``step`` before ``reset``, after the episode ended, or with a non-``str`` action.
- Built-in envs also offer ``oracle_action() -> str``: what a perfect model would emit next in the current
  state (tests, SFT warm start). Seeds for training vs evaluation: ``envs.seeds``.

``format_errors`` counts malformed calls, unknown tools, bad arguments, calls over ``max_calls_per_turn`` and
a final answer without the ``Final answer:`` marker.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import gymnasium as gym

from envs.parsing import CallError, parse_turn
from envs.spaces import ChatObservation, FreeText
from envs.tools import Tool, invoke

COUNTERS = ("turns", "tool_calls", "format_errors", "tool_errors", "tool_timeouts")
C = TypeVar("C")


def resolve_config(presets: dict[str, C], difficulty: str, overrides: dict[str, Any]) -> C:
    """The ``difficulty`` preset (a frozen dataclass) with ``overrides`` applied; lists become tuples."""
    if difficulty not in presets:
        raise ValueError(f"difficulty must be one of {list(presets)}, got {difficulty!r}")
    base = presets[difficulty]
    fields = [f.name for f in dataclasses.fields(base)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"unknown {type(base).__name__} option(s) {unknown}; known: {fields}")
    return dataclasses.replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})


class ToolEnv(gym.Env[dict, str]):
    """Base class: subclasses provide tools, ``_new_task``, ``_is_correct`` and ``oracle_action``."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        tools: list[Tool],
        max_turns: int = 8,
        max_calls_per_turn: int = 8,
        max_observation_chars: int = 4096,
    ) -> None:
        if max_turns < 1 or max_calls_per_turn < 1 or max_observation_chars < 64:
            raise ValueError("need max_turns >= 1, max_calls_per_turn >= 1, max_observation_chars >= 64")
        self.tools = {t.name: t for t in tools}
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_observation_chars = max_observation_chars
        self.observation_space = ChatObservation()
        self.action_space = FreeText()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._running = False

    # -- subclass hooks -------------------------------------------------------------------------------------
    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        """Draw a task from ``self.np_random``; return the opening system/user messages."""
        raise NotImplementedError

    def _is_correct(self, answer: str) -> bool:
        raise NotImplementedError

    def oracle_action(self) -> str:
        raise NotImplementedError

    # -- gymnasium API ------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._counters = dict.fromkeys(COUNTERS, 0)
        messages = self._new_task(options)
        self._running = True
        obs = {"messages": messages, "tools": [t.schema() for t in self.tools.values()]}
        return obs, {"seed": seed}

    def step(self, action: str):
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's turn as str, got {type(action).__name__}")
        if not self._running:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        c = self._counters
        c["turns"] += 1
        turn = parse_turn(action)
        if turn.answer is not None:
            self._running = False
            c["format_errors"] += 0 if turn.answer_marker else 1
            success = bool(self._is_correct(turn.answer))
            info = {**c, "call_kinds": [], "success": success, "answer": turn.answer}
            return {"messages": []}, 0.0, True, False, info
        messages, kinds = [], []
        for call in turn.calls[: self.max_calls_per_turn]:
            c["tool_calls"] += 1
            if isinstance(call, CallError):
                content, kind = f"error: {call.message}", "malformed"
            else:
                result = invoke(self.tools, call.name, call.arguments)
                content, kind = result.content, result.kind
            kinds.append(kind)
            c["format_errors"] += kind in ("malformed", "unknown_tool", "bad_arguments")
            c["tool_errors"] += kind == "tool_error"
            c["tool_timeouts"] += kind == "timeout"
            messages.append({"role": "tool", "content": self._clip(content)})
        extra = len(turn.calls) - self.max_calls_per_turn
        if extra > 0:
            c["tool_calls"] += extra
            c["format_errors"] += extra
            kinds.append("ignored")
            messages.append(
                {"role": "tool", "content": f"error: {extra} more tool call(s) ignored "
                 f"(at most {self.max_calls_per_turn} per turn)"}
            )
        truncated = c["turns"] >= self.max_turns
        info = {**c, "call_kinds": kinds}
        if truncated:
            self._running = False
            info.update(success=False, answer=None)
        return {"messages": messages}, 0.0, False, truncated, info

    def _clip(self, text: str) -> str:
        """Cut to ``max_observation_chars`` and make it valid UTF-8 (lone surrogates become '?')."""
        n = self.max_observation_chars
        text = text if len(text) <= n else f"{text[:n]}\n... [truncated {len(text) - n} characters]"
        return text.encode("utf-8", errors="replace").decode("utf-8")
