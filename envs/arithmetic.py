"""Tool-using arithmetic: compute a value with a ``calculator`` tool, then give ``Final answer: N``.

Difficulty presets (any field can be overridden by a keyword argument of the same name):
- ``easy``: one binary operation (+ - *) on integers 0..9: one calculator call, then the answer. The whole
  episode is about 100 tokens with the 512-token BPE of ``model/tokenizer.py``; prompts are short and regular.
- ``medium``: one expression with 3 operations on integers 0..99 (one call suffices).
- ``hard``: a chain of 3 steps ``a = ...; b = ... a ...; c = ...``, 2 operations each, integers 0..999 and
  floor division ``//``: one calculator call per step (the calculator knows no variables).
The answer is the integer value of the last step; it is read leniently (first number after the marker).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from envs.base import ToolEnv, resolve_config
from envs.calculator import CalcError, evaluate, format_number
from envs.parsing import first_number, format_call
from envs.tools import Tool, ToolError, object_schema

Difficulty = Literal["easy", "medium", "hard"]
VARS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class ArithmeticConfig:
    steps: int  # chained computations; each step after the first uses the previous step's variable
    ops_per_step: int  # binary operations per step
    max_operand: int  # literals are drawn from 0..max_operand (divisors from 1..max(2, max_operand // 50))
    operators: tuple[str, ...]  # among + - * //
    max_turns: int


PRESETS: dict[str, ArithmeticConfig] = {
    "easy": ArithmeticConfig(steps=1, ops_per_step=1, max_operand=9, operators=("+", "-", "*"), max_turns=4),
    "medium": ArithmeticConfig(steps=1, ops_per_step=3, max_operand=99, operators=("+", "-", "*"), max_turns=6),
    "hard": ArithmeticConfig(steps=3, ops_per_step=2, max_operand=999, operators=("+", "-", "*", "//"), max_turns=10),
}
SYSTEM = "Use the calculator tool, then reply: Final answer: <number>"


@dataclass(frozen=True)
class Step:
    var: str
    expression: str  # as shown to the model, may mention the previous variable
    value: int


class ArithmeticEnv(ToolEnv):
    def __init__(self, difficulty: Difficulty = "easy", **overrides: Any) -> None:
        cfg = resolve_config(PRESETS, difficulty, overrides)
        bad_ops = set(cfg.operators) - {"+", "-", "*", "//"}
        if cfg.steps < 1 or cfg.ops_per_step < 1 or cfg.max_operand < 1 or not cfg.operators or bad_ops:
            raise ValueError(f"invalid arithmetic config {cfg}")
        self.config = cfg
        calculator = Tool(
            name="calculator",
            description="Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).",
            parameters=object_schema({"expression": {"type": "string"}}),
            fn=self._calculator,
            timeout_s=2.0,
        )
        super().__init__([calculator], max_turns=cfg.max_turns)
        self._steps: list[Step] = []
        self._progress = 0  # steps whose value the calculator has returned, in order

    # -- task ---------------------------------------------------------------------------------------------
    def _literal(self, divisor: bool = False) -> int:
        top = max(2, self.config.max_operand // 50) if divisor else self.config.max_operand
        return int(self.np_random.integers(1 if divisor else 0, top + 1))

    def _expression(self, prev: str | None) -> str:
        """Left-to-right chain of operations, randomly parenthesised; ``prev`` replaces one non-divisor literal."""
        cfg = self.config
        ops = [str(self.np_random.choice(cfg.operators)) for _ in range(cfg.ops_per_step)]
        slots = [0] + [i + 1 for i, op in enumerate(ops) if op != "//"]  # operand positions that may hold prev
        var_slot = int(self.np_random.choice(slots)) if prev else -1
        operands = [prev if i == var_slot else str(self._literal(i > 0 and ops[i - 1] == "//")) for i in range(len(ops) + 1)]
        expr = operands[0]
        for i, op in enumerate(ops):
            if i > 0 and self.np_random.random() < 0.5:
                expr = f"({expr})"
            expr = f"{expr} {op} {operands[i + 1]}"
        return expr

    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        self._steps, self._progress = [], 0
        prev = None
        for j in range(self.config.steps):
            var = VARS[j % len(VARS)] + ("" if j < len(VARS) else str(j // len(VARS)))
            expr = self._expression(prev)
            value = evaluate(self._substitute(expr))
            self._steps.append(Step(var, expr, int(value)))
            prev = var
        if len(self._steps) == 1:
            user = f"Compute {self._steps[0].expression}."
        else:
            defs = "; ".join(f"{s.var} = {s.expression}" for s in self._steps)
            user = f"Let {defs}. What is {self._steps[-1].var}?"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def _substitute(self, expr: str) -> str:
        for s in self._steps:
            expr = re.sub(rf"\b{s.var}\b", f"({s.value})" if s.value < 0 else str(s.value), expr)
        return expr

    @property
    def answer(self) -> int:
        return self._steps[-1].value

    # -- tool, scoring, oracle ------------------------------------------------------------------------------
    def _calculator(self, expression: str) -> str:
        try:
            result = format_number(evaluate(expression))
        except CalcError as e:
            raise ToolError(str(e)) from None
        if self._progress < len(self._steps) and result == str(self._steps[self._progress].value):
            self._progress += 1
        return result

    def _is_correct(self, answer: str) -> bool:
        value = first_number(answer)
        return value is not None and value == self.answer

    def oracle_action(self) -> str:
        if self._progress < len(self._steps):
            return format_call("calculator", {"expression": self._substitute(self._steps[self._progress].expression)})
        return f"Final answer: {self.answer}"
