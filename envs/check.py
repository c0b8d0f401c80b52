"""``marathon env check``: validate an environment against the contract of ``envs/base.py``.

Checks, in order: it can be made; it is a ``gymnasium.Env``; ``reset`` returns the documented shapes;
two resets with one seed give the same observation; malformed tool calls come back as observations (no
exception); the oracle (if the env has ``oracle_action``) solves every seed; random-policy episodes end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from envs.episodes import (
    ContractError,
    RandomPolicy,
    obs_fingerprint,
    oracle_policy,
    reset_problems,
    run_episode,
    step_problems,
)
from envs.registry import make

PROBE_ACTIONS = (
    "<tool_call>{not json</tool_call>",
    '<tool_call>{"name": "__no_such_tool__", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
)


@dataclass
class CheckReport:
    env_id: str
    problems: list[str] = field(default_factory=list)
    oracle_rate: float | None = None  # None: the env has no oracle_action
    random_rate: float | None = None
    seeds: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _probe_errors(env: gym.Env, seed: int) -> list[str]:
    out = []
    for action in PROBE_ACTIONS:
        env.reset(seed=seed)
        try:
            result = env.step(action)
        except Exception as e:  # noqa: BLE001 - this is what the check looks for
            out.append(f"step({action!r}) raised {type(e).__name__}: {e} (model mistakes must become observations)")
            continue
        problems = step_problems(result)
        out += [f"step({action!r}): {p}" for p in problems]
        if not problems and not any(m["content"] for m in result[0]["messages"]):
            out.append(f"step({action!r}) returned no tool message explaining the error")
    return out


def check_env(env_id: str, kwargs: dict[str, Any] | None = None, seeds: list[int] | None = None,
              max_steps: int = 200) -> CheckReport:
    seeds = list(range(5)) if seeds is None else seeds
    report = CheckReport(env_id, seeds=len(seeds))
    try:
        env = make(env_id, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - reported
        report.problems.append(f"could not make {env_id!r}: {type(e).__name__}: {e}")
        return report
    try:
        if not isinstance(env.unwrapped, gym.Env):
            report.problems.append(f"{type(env.unwrapped).__name__} is not a gymnasium.Env subclass")
            return report
        seed = seeds[0] if seeds else 0
        try:
            first, second = env.reset(seed=seed), env.reset(seed=seed)
        except Exception as e:  # noqa: BLE001
            report.problems.append(f"reset(seed={seed}) raised {type(e).__name__}: {e}")
            return report
        report.problems += [f"reset(seed={seed}): {p}" for p in reset_problems(first)]
        if report.problems:
            return report
        if obs_fingerprint(first[0]) != obs_fingerprint(second[0]):
            report.problems.append(f"not deterministic: two resets with seed={seed} gave different observations")
        report.problems += _probe_errors(env, seed)
        policies = [("random", RandomPolicy(seed))]
        if callable(getattr(env.unwrapped, "oracle_action", None)):
            policies.insert(0, ("oracle", oracle_policy))
        for name, policy in policies:
            wins = []
            for s in seeds:
                try:
                    wins.append(run_episode(env, policy, s, max_steps).success)
                except ContractError as e:
                    report.problems.append(f"{name} episode: {e}")
                except Exception as e:  # noqa: BLE001
                    report.problems.append(f"{name} episode (seed={s}) raised {type(e).__name__}: {e}")
            rate = sum(wins) / len(wins) if wins else 0.0
            setattr(report, f"{name}_rate", rate)
            if name == "oracle" and wins and rate < 1.0:
                failed = [s for s, w in zip(seeds, wins) if not w]
                report.problems.append(f"oracle failed on seeds {failed} (success rate {rate:.2f}, expected 1.0)")
    finally:
        env.close()
    return report
