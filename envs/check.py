"""``marathon env check``: validate an environment against the contract of ``envs/base.py``.

Checks, in order: it can be made; it is a ``gymnasium.Env``; ``reset`` returns the documented shapes;
two resets with one seed give the same observation; malformed tool calls come back as observations (no
exception); the oracle (if the env has ``oracle_action``) solves every seed; random-policy episodes end;
whole episodes are deterministic under a seed (the same actions give the same observations, on one instance
again and on fresh ones); the opening prompt and the observations fit the context budget; several instances
stepped concurrently from threads give the episodes they give alone. Every env call runs under a time limit
(``envs.guard``): a call that hangs is reported, with the line it hangs on, and ends the check.
An env with a ``check_dataset() -> (problems, notes)`` method (``envs/dataset.py``) adds its own checks.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from envs.episodes import (
    ContractError,
    Episode,
    RandomPolicy,
    obs_fingerprint,
    oracle_policy,
    reset_problems,
    run_episode,
    step_problems,
)
from envs.guard import call_limited
from envs.registry import make

CHARS_PER_TOKEN = 3.0  # a rough, low BPE average over English and JSON (large-vocabulary tokenizers do ~4)

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
    notes: list[str] = field(default_factory=list)  # what the env says about itself (dataset envs: sizes, tools)

    @property
    def ok(self) -> bool:
        return not self.problems


class EnvHung(BaseException):
    """An env call did not return within the check's time limit. A ``BaseException`` so that it passes the
    ``except Exception`` of every check on its way out: the env is stuck in a thread and must not be called
    again."""


class _TimedEnv:
    """``reset``/``step``/``close`` of an env under a time limit: an exception passes through as raised, a
    call past the limit raises ``EnvHung`` naming the call and the line it hangs on."""

    def __init__(self, env: Any, timeout_s: float | None, label: str) -> None:
        self.env, self.timeout_s, self.label = env, timeout_s, label
        self.hung = False

    @property
    def unwrapped(self) -> Any:
        return self.env.unwrapped

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        out = call_limited(fn, args, kwargs, timeout_s=self.timeout_s, name=f"{self.label}.{what}")
        if out.timed_out:
            self.hung = True
            raise EnvHung(f"{what} did not return within {self.timeout_s:g} s (a hang; the time limit is "
                          f"--timeout-s); it was at {out.where}")
        if isinstance(out.error, Exception):
            raise out.error
        if out.error is not None:  # SystemExit and the like, from the env: a failure of the env, not of the check
            raise RuntimeError(f"{what} raised {type(out.error).__name__}: {out.error}")
        return out.value

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self._call(f"reset(seed={seed})", self.env.reset, seed=seed, options=options)

    def step(self, action: str) -> Any:
        return self._call(f"step({action[:60]!r})", self.env.step, action)

    def close(self) -> None:
        if not self.hung:
            call_limited(self.env.close, timeout_s=self.timeout_s)


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


def _make(env_id: str, kwargs: dict[str, Any], timeout_s: float | None) -> _TimedEnv:
    out = call_limited(make, (env_id,), kwargs, timeout_s=None if timeout_s is None else 10 * timeout_s,
                       name=f"{env_id}.make")
    if out.timed_out:
        raise EnvHung(f"making {env_id!r} did not return within {10 * timeout_s:g} s")
    if out.error is not None:
        raise out.error if isinstance(out.error, Exception) else RuntimeError(repr(out.error))
    return _TimedEnv(out.value, timeout_s, env_id)


def check_env(env_id: str, kwargs: dict[str, Any] | None = None, seeds: list[int] | None = None,
              max_steps: int = 200, timeout_s: float | None = 30.0, context_tokens: int = 4096,
              threads: int = 4) -> CheckReport:
    """Check ``env_id`` (module doc); ``timeout_s`` limits each env call, ``context_tokens`` is the episode
    budget observations are held against, ``threads`` instances are stepped concurrently."""
    seeds = list(range(5)) if seeds is None else seeds
    report = CheckReport(env_id, seeds=len(seeds))
    try:
        env = _make(env_id, kwargs or {}, timeout_s)
    except EnvHung as e:
        report.problems.append(str(e))
        return report
    except Exception as e:  # noqa: BLE001 - reported
        report.problems.append(f"could not make {env_id!r}: {type(e).__name__}: {e}")
        return report
    try:
        _check(env, env_id, kwargs or {}, seeds, max_steps, timeout_s, context_tokens, threads, report)
    except EnvHung as e:
        report.problems.append(f"hangs: {e}")
    finally:
        env.close()
    return report


def _check(env: _TimedEnv, env_id: str, kwargs: dict[str, Any], seeds: list[int], max_steps: int,
           timeout_s: float | None, context_tokens: int, threads: int, report: CheckReport) -> None:
    if not isinstance(env.unwrapped, gym.Env):
        report.problems.append(f"{type(env.unwrapped).__name__} is not a gymnasium.Env subclass")
        return
    seed = seeds[0] if seeds else 0
    try:
        first, second = env.reset(seed=seed), env.reset(seed=seed)
    except Exception as e:  # noqa: BLE001
        report.problems.append(f"reset(seed={seed}) raised {type(e).__name__}: {e}")
        return
    report.problems += [f"reset(seed={seed}): {p}" for p in reset_problems(first)]
    if report.problems:
        return
    if obs_fingerprint(first[0]) != obs_fingerprint(second[0]):
        report.problems.append(f"not deterministic: two resets with seed={seed} gave different observations")
    report.problems += _probe_errors(env, seed)
    policies = [("random", RandomPolicy(seed))]
    if callable(getattr(env.unwrapped, "oracle_action", None)):
        policies.insert(0, ("oracle", oracle_policy))
    # rows without a reference solution (dataset envs) have no oracle action
    has_oracle = getattr(env.unwrapped, "has_oracle", lambda s: True)
    episodes: list[Episode] = []
    for name, policy in policies:
        wins = []
        run_seeds = seeds if name != "oracle" else [s for s in seeds if has_oracle(s)]
        for s in run_seeds:
            try:
                episodes.append(run_episode(env, policy, s, max_steps))
                wins.append(episodes[-1].success)
            except ContractError as e:
                report.problems.append(f"{name} episode: {e}")
            except Exception as e:  # noqa: BLE001
                report.problems.append(f"{name} episode (seed={s}) raised {type(e).__name__}: {e}")
        rate = sum(wins) / len(wins) if wins else 0.0
        setattr(report, f"{name}_rate", rate)
        if name == "oracle" and wins and rate < 1.0:
            failed = [s for s, w in zip(run_seeds, wins) if not w]
            report.problems.append(f"oracle failed on seeds {failed} (success rate {rate:.2f}, expected 1.0)")
    extra = getattr(env.unwrapped, "check_dataset", None)  # dataset envs: columns, tools, verifier, split
    if callable(extra):  # (says why the oracle failed, when the verifier rejects reference answers)
        problems, notes = extra()
        report.problems += problems
        report.notes += notes
    if report.problems:  # the checks below replay episodes that must first run at all
        return
    _check_sizes(episodes, context_tokens, report)
    _check_replay(env, env_id, kwargs, seeds[:max(threads, 1)], max_steps, timeout_s, threads, report)


def _tokens(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


def _check_sizes(episodes: list[Episode], context_tokens: int, report: CheckReport) -> None:
    """The opening prompt (messages + tool schemas) and each observation against the episode budget (sizes in
    characters; tokens estimated at ``CHARS_PER_TOKEN``)."""
    if not episodes:
        return
    prompt = obs = 0
    for ep in episodes:
        opening = [m for m in ep.messages if m["role"] in ("system", "user")]
        prompt = max(prompt, sum(len(m["content"]) for m in opening) + len(json.dumps(ep.tools)))
        obs = max([obs] + [len(m["content"]) for m in ep.messages if m["role"] == "tool"])
    report.notes.append(f"sizes: opening prompt up to {prompt} chars (~{_tokens(prompt)} tokens with tools), one "
                        f"observation up to {obs} chars (~{_tokens(obs)} tokens); budget {context_tokens} tokens")
    if _tokens(prompt) >= context_tokens:
        report.problems.append(f"the opening prompt (~{_tokens(prompt)} tokens, {prompt} chars) does not fit the "
                               f"context budget of {context_tokens} tokens")
    elif _tokens(prompt + obs) >= context_tokens:
        report.problems.append(f"an observation of ~{_tokens(obs)} tokens ({obs} chars) after a prompt of "
                               f"~{_tokens(prompt)} leaves no room in the context budget of {context_tokens} "
                               "tokens (lower the env's max_observation_chars)")


def _transcript(env: Any, seed: int, max_steps: int) -> list[dict[str, str]]:
    """A random-policy episode (actions from the seed alone) as its messages."""
    ep = run_episode(env, RandomPolicy(seed), seed, max_steps)
    return ep.messages + [{"role": "info", "content": f"success={ep.success}"}]


def _first_difference(a: list[dict], b: list[dict]) -> str:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"message {k}: {str(x)[:120]!r} vs {str(y)[:120]!r}"
    return f"lengths {len(a)} vs {len(b)} messages"


def _check_replay(env: _TimedEnv, env_id: str, kwargs: dict[str, Any], seeds: list[int], max_steps: int,
                  timeout_s: float | None, threads: int, report: CheckReport) -> None:
    """Whole episodes under a seed: the same actions must give the same observations on this instance again,
    and on ``threads`` fresh instances stepped concurrently (no state shared between instances)."""
    if not seeds:
        return
    reference = {s: _transcript(env, s, max_steps) for s in seeds}
    for s in seeds:
        again = _transcript(env, s, max_steps)
        if again != reference[s]:
            report.problems.append(f"not deterministic: seed {s} played twice with the same actions gave different "
                                   f"episodes ({_first_difference(reference[s], again)})")
    if threads < 2:
        return
    jobs = [seeds[i % len(seeds)] for i in range(threads)]
    results: list[Any] = [None] * threads
    start = threading.Barrier(threads)

    def play(i: int) -> None:
        try:
            mine = _make(env_id, kwargs, timeout_s)
            start.wait()
            results[i] = _transcript(mine, jobs[i], max_steps)
            mine.close()
        except BaseException as e:  # noqa: BLE001 - reported (EnvHung included)
            start.abort()
            results[i] = e

    workers = [threading.Thread(target=play, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i, res in enumerate(results):
        if isinstance(res, threading.BrokenBarrierError):
            continue  # another instance failed first
        if isinstance(res, BaseException):
            report.problems.append(f"{threads} instances stepped concurrently from threads: instance {i} (seed "
                                   f"{jobs[i]}) {'hangs: ' if isinstance(res, EnvHung) else 'raised '}"
                                   f"{type(res).__name__}: {res}")
        elif res != reference[jobs[i]]:
            report.problems.append(f"{threads} instances stepped concurrently from threads interfere: seed "
                                   f"{jobs[i]} gave a different episode than alone "
                                   f"({_first_difference(reference[jobs[i]], res)})")
