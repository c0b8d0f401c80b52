"""Gymnasium spaces for text agents: free text actions and chat-message observations."""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium import spaces

RESET_ROLES = ("system", "user")
STEP_ROLES = ("tool",)


def _tool_problems(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        return [f"obs['tools'] must be a list, got {type(tools).__name__}"]
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            out.append(f"obs['tools'][{i}] must be {{'type': 'function', 'function': {{...}}}}")
            continue
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            out.append(f"obs['tools'][{i}]['function']['name'] must be a non-empty str")
        if not isinstance(fn.get("description"), str):
            out.append(f"obs['tools'][{i}]['function']['description'] must be a str")
        params = fn.get("parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            out.append(f"obs['tools'][{i}]['function']['parameters'] must be a JSON schema with type 'object'")
    return out


def observation_problems(obs: Any, first: bool) -> list[str]:
    """What is wrong with ``obs`` (empty if nothing). ``first``: obs from ``reset`` (else from ``step``)."""
    if not isinstance(obs, dict):
        return [f"obs must be a dict, got {type(obs).__name__}"]
    expected = {"messages", "tools"} if first else {"messages"}
    if set(obs) != expected:
        return [f"obs keys must be {sorted(expected)}, got {sorted(obs)}"]
    msgs = obs["messages"]
    if not isinstance(msgs, list):
        return [f"obs['messages'] must be a list, got {type(msgs).__name__}"]
    out = ["reset obs['messages'] must not be empty"] if first and not msgs else []
    roles = RESET_ROLES if first else STEP_ROLES
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            out.append(f"obs['messages'][{i}] must be a dict with exactly 'role' and 'content'")
        elif m["role"] not in roles:
            out.append(f"obs['messages'][{i}]['role'] must be one of {roles}, got {m['role']!r}")
        elif not isinstance(m["content"], str):
            out.append(f"obs['messages'][{i}]['content'] must be a str, got {type(m['content']).__name__}")
    if first:
        out += _tool_problems(obs["tools"])
    return out


class ChatObservation(spaces.Space[dict]):
    """Observations of ``envs.base`` (see its contract); ``contains`` accepts reset and step observations."""

    def contains(self, x: Any) -> bool:
        return not observation_problems(x, first=True) or not observation_problems(x, first=False)


class FreeText(spaces.Space[str]):
    """Any string up to ``max_length`` characters (a model's turn). ``sample`` gives printable noise."""

    def __init__(self, max_length: int = 1 << 20, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(0, min(self.max_length, 200) + 1))
        chars = np.array(list(string.printable))
        return "".join(self.np_random.choice(chars, size=n))
