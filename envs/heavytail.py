"""A heavy-tailed agentic benchmark env: sessions whose number of turns and answer lengths vary by 10x or more.

``marathon/HeavyTail-v0``: a session of N questions, asked one per turn. Each question shows a string of L digits
and asks for it back (``Repeat: 40213``); every model turn is the answer to the current question, after which the
next question arrives (as a ``tool`` message, the only role a step may return), until N answers are in (then
the episode terminates). There are no tools: unlike ``ToolEnv``'s, a turn here is an answer, never a call. N and L are
drawn per task from truncated power laws, P(x) ~ x^-alpha on [min, max]: most sessions are short and most
answers brief, a few run to tens of turns and answers (the long tail that makes a lock-step rollout wait for the
slowest episode of every batch).

Every ``info`` (reset's and step's) carries ``max_new_tokens``, the next question's token budget (answer length +
``slack``): the rollout gives that turn at most that many tokens (``rollout/runner.py``), so turn lengths follow the task whatever the
policy says, a random one included, which is what a throughput benchmark needs.

info: ``turns``, ``correct`` (answers right so far), ``format_errors`` (0: there is no format to break); the
last step adds ``success`` (every answer right), ``score`` (the fraction right) and ``answer``.

Difficulty presets: ``bench`` (N 1..32, L 2..48, alpha 1.5: the throughput benchmark), ``easy`` (N 1..4,
L 1..4: learnable by the tiny models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from envs.base import resolve_config
from envs.spaces import ChatObservation, FreeText

SYSTEM = "Answer each question with the digits it asks for, nothing else."


@dataclass(frozen=True)
class HeavyTailConfig:
    min_turns: int
    max_turns: int
    min_digits: int
    max_digits: int
    alpha: float  # power-law exponent of both draws (larger: lighter tail)
    slack: int  # tokens of budget beyond the answer's digits


PRESETS: dict[str, HeavyTailConfig] = {
    "bench": HeavyTailConfig(min_turns=1, max_turns=32, min_digits=2, max_digits=48, alpha=1.5, slack=4),
    "easy": HeavyTailConfig(min_turns=1, max_turns=4, min_digits=1, max_digits=4, alpha=1.0, slack=4),
}


def power_law(rng: np.random.Generator, lo: int, hi: int, alpha: float) -> int:
    """An integer in [lo, hi] with P(x) proportional to x^-alpha."""
    xs = np.arange(lo, hi + 1)
    p = xs.astype(float) ** -alpha
    return int(rng.choice(xs, p=p / p.sum()))


class HeavyTailEnv(gym.Env[dict, str]):
    metadata = {"render_modes": []}

    def __init__(self, difficulty: str = "bench", **overrides: Any) -> None:
        cfg = resolve_config(PRESETS, difficulty, overrides)
        if not (1 <= cfg.min_turns <= cfg.max_turns and 1 <= cfg.min_digits <= cfg.max_digits and cfg.alpha >= 0
                and cfg.slack >= 1):
            raise ValueError(f"invalid heavy-tail config {cfg}")
        self.config = cfg
        self.observation_space = ChatObservation()
        self.action_space = FreeText()
        self._answers: list[str] = []
        self._t = 0
        self._correct = 0
        self._running = False

    # -- task ---------------------------------------------------------------------------------------------------
    def _question(self, i: int) -> list[dict[str, str]]:
        return [{"role": "user" if i == 0 else "tool", "content": f"Repeat: {self._answers[i]}"}]

    def _budget(self, i: int) -> int:
        return len(self._answers[i]) + self.config.slack

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        c, rng = self.config, self.np_random
        n = power_law(rng, c.min_turns, c.max_turns, c.alpha)
        lengths = [power_law(rng, c.min_digits, c.max_digits, c.alpha) for _ in range(n)]
        self._answers = ["".join(str(d) for d in rng.integers(0, 10, size=k)) for k in lengths]
        self._t, self._correct, self._running = 0, 0, True
        obs = {"messages": [{"role": "system", "content": SYSTEM}, *self._question(0)], "tools": []}
        return obs, {"seed": seed, "num_questions": n, "answer_digits": lengths, "max_new_tokens": self._budget(0)}

    @property
    def num_questions(self) -> int:
        return len(self._answers)

    def step(self, action: str):
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's turn as str, got {type(action).__name__}")
        if not self._running:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        given = "".join(re.findall(r"\d", action.replace("Final answer:", "")))
        self._correct += given == self._answers[self._t]
        self._t += 1
        info: dict[str, Any] = {"turns": self._t, "correct": self._correct, "format_errors": 0, "tool_calls": 0}
        if self._t == len(self._answers):
            self._running = False
            info.update(success=self._correct == len(self._answers), score=self._correct / len(self._answers),
                        answer=given)
            return {"messages": []}, 0.0, True, False, info
        info["max_new_tokens"] = self._budget(self._t)
        return {"messages": self._question(self._t)}, 0.0, False, False, info

    def oracle_action(self) -> str:
        return self._answers[self._t]
