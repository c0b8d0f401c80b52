"""Play whole episodes with a text policy (oracle or random), checking the contract at every step.

``run_episode(env, oracle_policy, seed).messages`` is a complete chat (system/user, then assistant and tool
turns): the oracle demonstrations an SFT warm start trains on.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from envs.parsing import format_call
from envs.spaces import observation_problems

# A policy maps (env, chat so far, tool schemas) to the model's next turn.
Policy = Callable[[gym.Env, list[dict[str, str]], list[dict[str, Any]]], str]


class ContractError(AssertionError):
    """The env broke the contract of ``envs/base.py``; the message says how."""


@dataclass
class Episode:
    seed: int | None
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    info: dict[str, Any]  # the last step's info
    steps: int

    @property
    def success(self) -> bool:
        return bool(self.info.get("success", False))


def step_problems(result: Any) -> list[str]:
    """What is wrong with one ``step`` return value."""
    if not isinstance(result, tuple) or len(result) != 5:
        return ["step must return a 5-tuple (obs, reward, terminated, truncated, info)"]
    obs, reward, terminated, truncated, info = result
    out = observation_problems(obs, first=False)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        out.append(f"reward must be a float, got {type(reward).__name__}")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool):
            out.append(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(info, dict):
        out.append(f"info must be a dict, got {type(info).__name__}")
    elif (terminated or truncated) and not isinstance(info.get("success"), bool):
        out.append("the last step's info must hold 'success' as a bool")
    return out


def reset_problems(result: Any) -> list[str]:
    if not isinstance(result, tuple) or len(result) != 2:
        return ["reset must return a 2-tuple (obs, info)"]
    obs, info = result
    out = observation_problems(obs, first=True)
    if not isinstance(info, dict):
        out.append(f"reset info must be a dict, got {type(info).__name__}")
    return out


def oracle_policy(env: gym.Env, messages: list[dict[str, str]], tools: list[dict[str, Any]]) -> str:
    return env.unwrapped.oracle_action()


class RandomPolicy:
    """Uniformly random behaviour: a tool call with schema-shaped random arguments, a random numeric or
    word answer, or printable noise. Its success rate is the floor a trained model must beat."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def _value(self, schema: dict[str, Any]) -> Any:
        kind = schema.get("type")
        low = int(schema.get("minimum", 0))
        if kind == "integer":
            return int(self.rng.integers(low, low + 1000))
        if kind == "number":
            return float(self.rng.uniform(low, low + 1000))
        if kind == "boolean":
            return bool(self.rng.integers(2))
        return self._word()

    def _word(self) -> str:
        return "".join(self.rng.choice(list(string.ascii_lowercase + string.digits + " +*-"), size=int(self.rng.integers(1, 12))))

    def __call__(self, env: gym.Env, messages: list[dict[str, str]], tools: list[dict[str, Any]]) -> str:
        choice = self.rng.random()
        if choice < 0.5 and tools:
            fn = tools[int(self.rng.integers(len(tools)))]["function"]
            props = fn.get("parameters", {}).get("properties", {})
            return format_call(fn["name"], {k: self._value(v) for k, v in props.items()})
        if choice < 0.8:
            return f"Final answer: {self.rng.integers(0, 100) if self.rng.random() < 0.7 else self._word()}"
        return self._word()


def run_episode(env: gym.Env, policy: Policy, seed: int | None, max_steps: int = 1000) -> Episode:
    """Reset with ``seed`` and step ``policy`` until the episode ends; raises ``ContractError`` if the env
    returns malformed values or does not end within ``max_steps``."""
    result = env.reset(seed=seed)
    problems = reset_problems(result)
    if problems:
        raise ContractError(f"reset(seed={seed}): " + "; ".join(problems))
    obs, info = result
    messages, tools = list(obs["messages"]), obs["tools"]
    for step in range(1, max_steps + 1):
        action = policy(env, messages, tools)
        messages.append({"role": "assistant", "content": action})
        result = env.step(action)
        problems = step_problems(result)
        if problems:
            raise ContractError(f"step {step} (seed={seed}, action={action[:80]!r}): " + "; ".join(problems))
        obs, _, terminated, truncated, info = result
        messages += obs["messages"]
        if terminated or truncated:
            return Episode(seed, messages, tools, info, step)
    raise ContractError(f"episode (seed={seed}) did not end within {max_steps} steps; is max_turns enforced?")


def success_rate(env: gym.Env, policy: Policy, seeds: list[int], max_steps: int = 1000) -> float:
    return float(np.mean([run_episode(env, policy, s, max_steps).success for s in seeds])) if seeds else 0.0


def obs_fingerprint(obs: Any) -> str:
    """A stable text form of an observation (to compare two resets)."""
    return json.dumps(obs, sort_keys=True, default=repr)
