"""Tools an environment offers: a JSON-schema description plus a Python function returning text.

``invoke`` never raises for the model's mistakes or the tool's failures; it returns a ``ToolResult`` whose
``content`` explains the problem, and ``kind`` says which class of problem it was (for diagnostics):
``ok``, ``unknown_tool``, ``bad_arguments``, ``tool_error`` (the tool raised), ``timeout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from jsonschema import Draft202012Validator

from envs.guard import call_limited  # a hung tool is abandoned (and counted) like a hung env call

ResultKind = Literal["ok", "unknown_tool", "bad_arguments", "tool_error", "timeout"]


class ToolError(Exception):
    """Raised by a tool for an expected failure; the message is shown to the model as is."""


class ToolTimeout(ToolError):
    """Raised by a tool that enforces its own time limit (e.g. a subprocess)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., str]
    # Wall-clock limit enforced by running the call in a daemon thread (a hung call is abandoned, not killed).
    # None: run inline; the tool enforces its own limit (and raises ToolTimeout).
    timeout_s: float | None = 5.0

    def __post_init__(self) -> None:
        Draft202012Validator.check_schema(self.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling description of this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def object_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """JSON schema of an arguments object: these properties (all required unless ``required`` is given)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class ToolResult:
    content: str
    kind: ResultKind


def _run_with_timeout(tool: Tool, args: dict[str, Any]) -> ToolResult:
    out = call_limited(tool.fn, (), args, timeout_s=tool.timeout_s, name=f"tool-{tool.name}")
    if out.timed_out:
        return ToolResult(f"error: tool {tool.name!r} timed out after {tool.timeout_s:g} s", "timeout")
    if out.error is not None:
        return _error_result(tool, out.error)
    return _value_result(tool, out.value)


def _error_result(tool: Tool, e: BaseException) -> ToolResult:
    if isinstance(e, ToolTimeout):
        return ToolResult(f"error: {e}", "timeout")
    if isinstance(e, ToolError):
        return ToolResult(f"error: {e}", "tool_error")
    return ToolResult(f"error: tool {tool.name!r} failed: {type(e).__name__}: {e}", "tool_error")


def _value_result(tool: Tool, value: Any) -> ToolResult:
    if not isinstance(value, str):
        return ToolResult(f"error: tool {tool.name!r} returned {type(value).__name__}, not text", "tool_error")
    return ToolResult(value, "ok")


def invoke(tools: dict[str, Tool], name: str, arguments: dict[str, Any]) -> ToolResult:
    tool = tools.get(name)
    if tool is None:
        return ToolResult(f"error: unknown tool {name!r}; available tools: {', '.join(sorted(tools))}", "unknown_tool")
    errors = sorted(Draft202012Validator(tool.parameters).iter_errors(arguments), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = f"argument {'.'.join(map(str, e.path))!r}: " if e.path else ""
        msg = e.message if len(e.message) <= 300 else e.message[:300] + "..."
        return ToolResult(f"error: bad arguments for tool {name!r}: {where}{msg}", "bad_arguments")
    if tool.timeout_s is not None:
        return _run_with_timeout(tool, arguments)
    try:
        return _value_result(tool, tool.fn(**arguments))
    except Exception as e:  # noqa: BLE001 - any failure becomes feedback to the model
        return _error_result(tool, e)
