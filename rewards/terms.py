"""Built-in reward terms. A term maps an episode's outcome to a number (before its weight):
``term(info, num_model_tokens, num_turns, **params) -> float``; custom ``module:function`` terms use the
same signature. ``info`` is the episode's last step info (``envs/base.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FormatParams(NoParams):
    cap: int | None = Field(default=None, ge=0)  # count at most this many format errors


class TurnParams(NoParams):
    free_turns: int = Field(default=0, ge=0)  # turns that cost nothing


class LengthParams(NoParams):
    free_tokens: int = Field(default=0, ge=0)  # model tokens that cost nothing


def success(info: dict[str, Any], num_model_tokens: int, num_turns: int) -> float:
    """1 if the task was solved, else 0."""
    if not isinstance(info.get("success"), bool):
        raise ValueError("info has no bool 'success'; score the last step's info of a finished episode")
    return float(info["success"])


def format_errors(info: dict[str, Any], num_model_tokens: int, num_turns: int, cap: int | None = None) -> float:
    """Minus the number of tool-call format errors (malformed calls, unknown tools, bad arguments, ...)."""
    n = int(info.get("format_errors", 0))
    return -float(n if cap is None else min(n, cap))


def turn_penalty(info: dict[str, Any], num_model_tokens: int, num_turns: int, free_turns: int = 0) -> float:
    """Minus the number of turns beyond ``free_turns``."""
    return -float(max(0, num_turns - free_turns))


def length_penalty(info: dict[str, Any], num_model_tokens: int, num_turns: int, free_tokens: int = 0) -> float:
    """Minus the number of generated (model) tokens beyond ``free_tokens``."""
    return -float(max(0, num_model_tokens - free_tokens))


# name -> (function, params model)
BUILTIN_TERMS = {
    "success": (success, NoParams),
    "format": (format_errors, FormatParams),
    "turn_penalty": (turn_penalty, TurnParams),
    "length_penalty": (length_penalty, LengthParams),
}
