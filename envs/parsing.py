"""Parse one model turn into tool calls or a final answer.

Tool calls use the Qwen/Hermes convention: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, one
or more per turn, anywhere in the text. Leniency, on purpose:
- the closing ``</tool_call>`` of the last call may be missing (servers often stop on it and drop it);
- whitespace and a surrounding Markdown code fence inside the tags are ignored;
- ``arguments`` may be a JSON object or a JSON-encoded string holding one (OpenAI style); missing means ``{}``.
A turn with no ``<tool_call>`` tag is the final answer: the text after the last ``Final answer:`` marker
(case-insensitive, any whitespace, ``:`` or ``=`` optional), up to the end of that line. Without a marker the
whole stripped turn is taken as the answer and the turn counts one format error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANSWER = re.compile(r"final\s*answer\s*[:=]?[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A ``<tool_call>`` block that could not be read; ``message`` is shown to the model."""

    message: str


@dataclass
class ParsedTurn:
    calls: list[ToolCall | CallError] = field(default_factory=list)
    answer: str | None = None  # set only when the turn has no tool-call block
    answer_marker: bool = False  # the answer came after a "Final answer:" marker


def _blocks(text: str) -> list[str]:
    """Contents of each ``<tool_call>`` block: up to its ``</tool_call>``, the next ``<tool_call>`` or the end.
    Linear time: the next closing tag is searched again only once the scan has passed it."""
    out, pos, close = [], text.find(OPEN), -2
    while pos != -1:
        start = pos + len(OPEN)
        if close != -1 and close < start:
            close = text.find(CLOSE, start)
        nxt = text.find(OPEN, start)
        ends = [e for e in (nxt, close) if e != -1]
        out.append(text[start:min(ends) if ends else len(text)])
        pos = nxt
    return out


def _unfence(body: str) -> str:
    """Strip a Markdown code fence (with an optional language tag) around a call."""
    if len(body) >= 6 and body.startswith("```") and body.endswith("```"):
        inner = body[3:-3]
        first, newline, rest = inner.partition("\n")
        return (rest if newline and first.strip().isalnum() else inner).strip()
    return body


def parse_call(body: str) -> ToolCall | CallError:
    body = _unfence(body.strip())
    if not body:
        return CallError('empty <tool_call> block; expected {"name": ..., "arguments": {...}}')
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return CallError(f"malformed JSON in tool call: {e.msg} at character {e.pos}")
    except (ValueError, RecursionError) as e:  # e.g. a 5000-digit integer, nesting too deep
        return CallError(f"malformed JSON in tool call: {type(e).__name__}: {str(e)[:200]}")
    if body[end:].strip():
        return CallError(f"unexpected text after the JSON object in tool call: {body[end:end + 40].strip()!r}")
    if not isinstance(obj, dict):
        return CallError(f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if name is None:
        return CallError('tool call is missing "name"')
    if not isinstance(name, str):
        return CallError(f'tool call "name" must be a string, got {type(name).__name__}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return CallError(f'tool call "arguments" string is not valid JSON: {str(e)[:200]}')
    if not isinstance(args, dict):
        return CallError(f'tool call "arguments" must be a JSON object, got {type(args).__name__}')
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return CallError(f'tool call has unexpected keys {extra}; expected only "name" and "arguments"')
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str) -> ParsedTurn:
    blocks = _blocks(text)
    if blocks:
        return ParsedTurn(calls=[parse_call(b) for b in blocks])
    answers = _ANSWER.findall(text)
    if answers:
        return ParsedTurn(answer=answers[-1].strip(), answer_marker=True)
    return ParsedTurn(answer=text.strip(), answer_marker=False)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one tool call (what oracles emit)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"


def first_number(answer: str) -> float | None:
    """The first number in an answer (thousands separators ignored), or None."""
    m = _NUMBER.search(answer.replace(",", ""))
    return float(m.group()) if m else None
