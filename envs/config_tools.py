"""Tools (and check functions) named in a config: ``module:function``, ``path/to/file.py:function`` or an
entry point of the ``marathon.tools`` group, turned into ``envs.Tool`` objects.

- **Schema**: the JSON schema of the arguments comes from the function's signature and docstring (read with
  ``ast`` from the source, so an untrusted file is never imported here) unless the config gives
  ``parameters``. Annotations map to JSON types (``str`` string, ``int`` integer, ``float`` number, ``bool``
  boolean, ``list[X]`` array, ``dict`` object, ``Literal[...]`` enum, ``X | None`` nullable); a parameter
  with a default is optional; the description is the docstring's first paragraph, parameter descriptions
  come from a Google (``Args:``), Sphinx (``:param x:``) or NumPy (``Parameters``) section.
- **Row arguments**: ``bind: {param: column}`` fills ``param`` from the task row's ``column`` at call time;
  bound parameters are not shown to the model.
- **Untrusted** (``untrusted: true``): the function's source file runs in the code sandbox
  (``envs/sandbox.py``: a subprocess, standard library only, time and memory limits, no network) once per
  call, arguments and result passing as JSON; ``envs.ToolError`` works there too (a stand-in ``envs``
  module). The file is loaded once in the sandbox when the env is made, so a file that does not import
  there fails up front.
- **Results**: text is returned as is, numbers and booleans as ``str()``, lists and dicts as JSON; ``None``
  or anything else is a tool error. Errors follow the contract of built-in tools (``envs/tools.py``).

Everything wrong with a spec raises ``SpecError`` naming the config key (``env.kwargs.tools[0].function``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import re
import shutil
import sys
import tempfile
import textwrap
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from envs.tools import Tool, ToolError, ToolTimeout

ENTRY_POINT_GROUP = "marathon.tools"
MARKER = "\x1e__marathon_result__\x1e"


class SpecError(ValueError):
    """A tool or verifier spec that cannot be used: ``key: problem`` (``key`` is the config key)."""

    def __init__(self, key: str, problem: str) -> None:
        self.config_key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


# -- finding functions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionRef:
    """Where a function lives: ``source`` is its file's text (for the schema and the sandbox)."""

    text: str  # as written in the config
    module: str  # a dotted module name, or a file path
    function: str
    path: Path | None  # the source file, when there is one
    source: str | None

    @property
    def is_file(self) -> bool:
        return self.module.endswith(".py") or "/" in self.module


def _split(text: str, key: str) -> tuple[str, str]:
    module, sep, function = text.rpartition(":")
    if not sep or not module or not function.isidentifier():
        raise SpecError(key, f"expected 'module:function' or 'path/to/file.py:function', got {text!r}")
    return module, function


def _module_file(module: str) -> Path | None:
    """The source file of a dotted module, found on ``sys.path`` without importing anything."""
    parts = module.split(".")
    for base in sys.path:
        root = Path(base or ".")
        for cand in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if cand.is_file():
                return cand
    return None


def find_function(text: str, key: str, untrusted: bool = False) -> FunctionRef:
    """Locate ``module:function`` / ``file.py:function`` and read its source (nothing is imported)."""
    module, function = _split(text, key)
    if module.endswith(".py") or "/" in module:
        path = Path(module)
        if not path.is_file():
            raise SpecError(key, f"{module}: no such file (relative paths are from the working directory {Path.cwd()})")
    else:
        path = _module_file(module)
        if path is None and untrusted:
            raise SpecError(key, f"cannot find the source of module {module!r} on sys.path (an untrusted function "
                                 "must be Python source: a module or a .py file)")
    source = None
    if path is not None:
        try:
            source = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(key, f"cannot read {path}: {e}") from None
    return FunctionRef(text, module, function, path, source)


def _import_file(path: Path) -> Any:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"marathon_user_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def import_function(ref: FunctionRef, key: str) -> Callable[..., Any]:
    """Import a trusted function (in this process)."""
    try:
        mod = _import_file(ref.path) if ref.is_file else importlib.import_module(ref.module)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix; one message
        raise SpecError(key, f"cannot import {ref.module!r} ({type(e).__name__}: {e})") from None
    fn = getattr(mod, ref.function, None)
    if fn is None:
        raise SpecError(key, f"module {ref.module!r} has no attribute {ref.function!r}")
    if not callable(fn):
        raise SpecError(key, f"{ref.text} is not callable (it is a {type(fn).__name__})")
    return fn


def entry_point_function(name: str, key: str) -> tuple[FunctionRef, Callable[..., Any]]:
    """A function published under the ``marathon.tools`` entry-point group (trusted: it is imported)."""
    eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not eps:
        known = sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        raise SpecError(key, f"no {ENTRY_POINT_GROUP!r} entry point named {name!r}; installed: {known or 'none'}")
    try:
        fn = eps[0].load()
    except Exception as e:  # noqa: BLE001
        raise SpecError(key, f"entry point {name!r} ({eps[0].value}) does not load ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise SpecError(key, f"entry point {name!r} ({eps[0].value}) is not callable")
    module, _, function = eps[0].value.partition(":")
    path = _module_file(module.strip())
    source = path.read_text() if path is not None else None
    return FunctionRef(eps[0].value, module.strip(), function.strip(), path, source), fn


# -- schemas from signatures ------------------------------------------------------------------------------------
_SIMPLE = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
           "List": "array", "tuple": "array", "Tuple": "array", "Sequence": "array", "set": "array",
           "dict": "object", "Dict": "object", "Mapping": "object"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.Optional, t.List
        return node.attr
    return ""


def annotation_schema(node: ast.AST | None) -> dict[str, Any]:
    """The JSON schema of one annotation (``{}`` = anything, for what has no JSON counterpart)."""
    if node is None:
        return {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            return annotation_schema(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return {}
    if isinstance(node, ast.Constant) and node.value is None:
        return {"type": "null"}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([annotation_schema(node.left), annotation_schema(node.right)])
    name = _name(node)
    if name in _SIMPLE:
        return {"type": _SIMPLE[name]}
    if name == "None":
        return {"type": "null"}
    if isinstance(node, ast.Subscript):
        outer = _name(node.value)
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer == "Optional":
            return _union([annotation_schema(args[0]), {"type": "null"}])
        if outer == "Union":
            return _union([annotation_schema(a) for a in args])
        if outer == "Literal":
            values = [a.value for a in args if isinstance(a, ast.Constant)]
            return {"enum": values} if len(values) == len(args) else {}
        if outer == "Annotated":
            return annotation_schema(args[0])
        if _SIMPLE.get(outer) == "array":
            items = annotation_schema(args[0]) if outer not in ("tuple", "Tuple") or len(args) == 2 else {}
            return {"type": "array", **({"items": items} if items else {})}
        if _SIMPLE.get(outer) == "object":
            return {"type": "object"}
    return {}


def _union(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if any(not p for p in parts):
        return {}
    if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
        return {"type": list(dict.fromkeys(p["type"] for p in parts))}
    return {"anyOf": parts}


def docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google, Sphinx or NumPy style docstring."""
    doc = inspect.cleandoc(doc or "")
    if not doc:
        return "", {}
    lines = doc.splitlines()
    params: dict[str, str] = {}
    for m in re.finditer(r"^:param\s+(?:[^:\s]+\s+)?(\w+):\s*(.+)$", doc, re.MULTILINE):
        params[m.group(1)] = m.group(2).strip()
    section = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters|Params)\s*:?", stripped):
            section = "google" if stripped.endswith(":") else "numpy"
            continue
        if section and (re.fullmatch(r"(Returns?|Raises|Yields|Examples?|Notes?|See Also)\s*:?", stripped)):
            section = None
            continue
        if section == "google":
            m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                params[m.group(1)] = m.group(2).strip()
        elif section == "numpy":
            m = re.match(r"^(\w+)\s*(?::.*)?$", line)
            if m and i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")) and not set(stripped) <= {"-"}:
                params[m.group(1)] = lines[i + 1].strip()
    description = []
    for line in lines:
        if not line.strip() or line.startswith(":") or re.fullmatch(r"(Args|Arguments|Parameters)\s*:?", line.strip()):
            break
        description.append(line.strip())
    return " ".join(description), params


@dataclass(frozen=True)
class Signature:
    description: str
    parameters: list[tuple[str, dict[str, Any], bool, str]]  # (name, schema, required, description)
    var_keyword: bool  # accepts **kwargs
    positional_only: tuple[str, ...] = ()


def _default(node: ast.AST) -> tuple[bool, Any]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return False, None
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False, None
    return True, value


def signature_from_source(source: str, function: str, key: str) -> Signature:
    """Parameters, their JSON schemas and descriptions of ``def function`` in ``source`` (not executed)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise SpecError(key, f"the source does not parse: {e.msg} (line {e.lineno})") from None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function),
                None)
    if node is None:
        raise SpecError(key, f"no top-level 'def {function}(...)' in the source")
    description, docs = docstring_parts(ast.get_docstring(node))
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = []
    for arg, default in list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults)):
        if arg.arg in ("self", "cls"):
            continue
        schema = annotation_schema(arg.annotation)
        if default is not None:
            ok, value = _default(default)
            if ok:
                schema = {**schema, "default": value}
        if arg.arg in docs:
            schema = {**schema, "description": docs[arg.arg]}
        params.append((arg.arg, schema, default is None, docs.get(arg.arg, "")))
    return Signature(description, params, a.kwarg is not None, tuple(p.arg for p in a.posonlyargs))


def signature_from_callable(fn: Callable[..., Any], key: str) -> Signature:
    """Like ``signature_from_source`` for an imported function; falls back to ``inspect`` (untyped
    parameters) when its source is not available (builtins, C extensions)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        name = fn.__name__
        sig = signature_from_source(source, name, key)
        if not sig.description and fn.__doc__:
            sig = Signature(docstring_parts(fn.__doc__)[0], sig.parameters, sig.var_keyword, sig.positional_only)
        return sig
    except (OSError, TypeError, AttributeError, SpecError):
        pass
    try:
        s = inspect.signature(fn)
    except (TypeError, ValueError):
        raise SpecError(key, f"cannot read the signature of {fn!r}; give 'parameters' explicitly") from None
    description, docs = docstring_parts(getattr(fn, "__doc__", None))
    params, var_kw, posonly = [], False, []
    for p in s.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is not p.VAR_POSITIONAL:
            posonly += [p.name] if p.kind is p.POSITIONAL_ONLY else []
            params.append((p.name, {"description": docs[p.name]} if p.name in docs else {},
                           p.default is p.empty, docs.get(p.name, "")))
    return Signature(description, params, var_kw, tuple(posonly))


def object_schema_from(sig: Signature, hidden: set[str]) -> dict[str, Any]:
    props = {name: schema for name, schema, _, _ in sig.parameters if name not in hidden}
    required = [name for name, _, req, _ in sig.parameters if req and name not in hidden]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


# -- results --------------------------------------------------------------------------------------------------
def result_text(name: str, value: Any) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (list, dict)):
        try:
            return json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            pass
    raise ToolError(f"tool {name!r} returned {type(value).__name__}, not text")


def call_by_name(fn: Callable[..., Any], arguments: dict[str, Any], positional_only: tuple[str, ...]) -> Any:
    """``fn(**arguments)``, passing positional-only parameters by position."""
    if not positional_only:
        return fn(**arguments)
    rest = dict(arguments)
    args = []
    for name in positional_only:
        if name not in rest:
            break
        args.append(rest.pop(name))
    return fn(*args, **rest)


# -- the sandbox ----------------------------------------------------------------------------------------------
# Runs in the sandbox (python -I -S -B, standard library only): loads the user's source, calls the function
# with JSON arguments, prints the marker and a JSON result. The user's own prints are swallowed.
_SANDBOX = r'''from __future__ import annotations
import contextlib, inspect, io, json, sys, traceback, types
_p = json.loads(__PAYLOAD__)
class ToolError(Exception):
    pass
class ToolTimeout(ToolError):
    pass
_envs, _tools = types.ModuleType("envs"), types.ModuleType("envs.tools")
for _m in (_envs, _tools):
    _m.ToolError, _m.ToolTimeout = ToolError, ToolTimeout
_envs.tools = _tools
sys.modules.update({"envs": _envs, "envs.tools": _tools})
__CALL_CHECK__
def _emit(obj):
    sys.__stdout__.write("\n" + _p["marker"] + json.dumps(obj, default=repr))
    sys.__stdout__.flush()
_ns = {"__name__": "marathon_user", "__file__": _p["filename"]}
try:
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(_p["source"], _p["filename"], "exec"), _ns)
        _fn = _ns.get(_p["function"])
        if not callable(_fn):
            raise NameError(f"{_p['filename']} defines no function {_p['function']!r}")
        if _p["mode"] == "probe":
            _value = None
        elif _p["mode"] == "check":
            _value = call_check(_fn, _p["answer"], _p["truth"], _p["row"], _p["params"])
        else:
            _value = _fn(**_p["arguments"])
    _emit({"value": _value})
except ToolError as e:
    _emit({"tool_error": str(e), "timeout": isinstance(e, ToolTimeout)})
except BaseException as e:
    _emit({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6)})
'''


def call_check(fn: Callable[..., Any], answer: str, truth: Any, row: dict[str, Any], params: dict[str, Any]) -> Any:
    """Call a check function ``fn(answer, truth[, row=row], **params)``: ``row`` only if it takes one."""
    try:
        ps = inspect.signature(fn).parameters.values()
        takes_row = any(p.name == "row" or p.kind is p.VAR_KEYWORD for p in ps)
    except (TypeError, ValueError):
        takes_row = False
    return fn(answer, truth, **({"row": row} if takes_row else {}), **params)


class SandboxFailure(Exception):
    """The sandboxed function raised or could not run; ``str()`` says why, ``traceback`` has the detail."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


@dataclass(frozen=True)
class SandboxSettings:
    timeout_s: float = 5.0
    memory_mb: int = 256


def sandbox_call(ref: FunctionRef, mode: str, payload: dict[str, Any], settings: SandboxSettings,
                 workdir: str | Path | None = None) -> Any:
    """Run ``ref.function`` from ``ref.source`` in the code sandbox; returns its JSON result.
    Raises ``ToolTimeout`` (time limit), ``ToolError`` (the function raised ``ToolError``) or
    ``SandboxFailure`` (any other failure)."""
    from envs.sandbox import SandboxLimits, run_python

    data = {"marker": MARKER, "mode": mode, "source": ref.source, "function": ref.function,
            "filename": str(ref.path or ref.module), **payload}
    code = (_SANDBOX.replace("__PAYLOAD__", repr(json.dumps(data, default=str)))
            .replace("__CALL_CHECK__", inspect.getsource(call_check)))
    limits = SandboxLimits(timeout_s=settings.timeout_s, memory_mb=settings.memory_mb, max_output_chars=1 << 20)
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="marathon-fn-")
        workdir = tmp
    try:
        r = run_python(code, workdir, limits)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if r.timed_out:
        raise ToolTimeout(f"{ref.function} timed out after {settings.timeout_s:g} s in the sandbox (process killed)")
    head, sep, tail = r.stdout.rpartition(MARKER)
    if not sep:
        why = r.stderr.strip().splitlines()[-1:] or [f"exit code {r.returncode}, no output"]
        raise SandboxFailure(f"{ref.function} did not finish in the sandbox: {why[0][:300]}", r.stderr[-2000:])
    try:
        out = json.loads(tail)
    except ValueError:
        raise SandboxFailure(f"{ref.function}: unreadable result from the sandbox", tail[-500:]) from None
    if "tool_error" in out:
        raise (ToolTimeout if out.get("timeout") else ToolError)(out["tool_error"])
    if "error" in out:
        raise SandboxFailure(out["error"], out.get("traceback", ""))
    return out["value"]


# -- tools from specs -----------------------------------------------------------------------------------------
@dataclass
class ConfigTool:
    """One configured tool, resolved once per config (an env makes its ``Tool`` objects from it)."""

    name: str
    description: str
    parameters: dict[str, Any]
    bind: dict[str, str]  # parameter -> row column
    timeout_s: float
    untrusted: bool
    ref: FunctionRef
    fn: Callable[..., Any] | None = None  # trusted only
    positional_only: tuple[str, ...] = ()
    memory_mb: int = 256

    def make(self, row: Callable[[], dict[str, Any]], workdir: Callable[[], Path]) -> Tool:
        """The ``Tool`` for one env: ``row()`` gives the current task row, ``workdir()`` the sandbox dir."""
        if self.untrusted:
            settings = SandboxSettings(self.timeout_s, self.memory_mb)

            def call(**arguments: Any) -> str:
                args = {**arguments, **{p: row()[c] for p, c in self.bind.items()}}
                try:
                    value = sandbox_call(self.ref, "tool", {"arguments": args}, settings, workdir())
                except SandboxFailure as e:
                    raise ToolError(f"tool {self.name!r} failed: {e}") from None
                return result_text(self.name, value)

            return Tool(self.name, self.description, self.parameters, call, timeout_s=None)

        def call_trusted(**arguments: Any) -> str:
            args = {**arguments, **{p: row()[c] for p, c in self.bind.items()}}
            return result_text(self.name, call_by_name(self.fn, args, self.positional_only))

        return Tool(self.name, self.description, self.parameters, call_trusted, timeout_s=self.timeout_s)


def build_tool(spec: dict[str, Any], key: str, columns: list[str]) -> ConfigTool:
    """Resolve one tool spec (already shape-checked: ``envs.dataset.ToolSpec``) against the data's columns."""
    untrusted = bool(spec.get("untrusted"))
    fn = None
    if spec.get("entry_point"):
        if untrusted:
            raise SpecError(f"{key}.entry_point", "an entry point is imported, so it cannot be untrusted; name its "
                                                  "file with 'function: path/to/file.py:function' instead")
        ref, fn = entry_point_function(spec["entry_point"], f"{key}.entry_point")
    else:
        ref = find_function(spec["function"], f"{key}.function", untrusted)
        if not untrusted:
            fn = import_function(ref, f"{key}.function")
    if untrusted:
        sig = signature_from_source(ref.source, ref.function, f"{key}.function")
    else:
        sig = signature_from_callable(fn, f"{key}.{'entry_point' if spec.get('entry_point') else 'function'}")
    names = {p[0] for p in sig.parameters}
    bind = dict(spec.get("bind") or {})
    for param, column in bind.items():
        if param not in names and not sig.var_keyword:
            raise SpecError(f"{key}.bind.{param}", f"{ref.function}() has no parameter {param!r}; its parameters: "
                                                   f"{sorted(names)}")
        if column not in columns:
            raise SpecError(f"{key}.bind.{param}", f"column {column!r} is not in the data; columns: {columns}")
        if param in sig.positional_only:
            raise SpecError(f"{key}.bind.{param}", "a bound parameter cannot be positional-only")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = object_schema_from(sig, set(bind))
    else:
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as e:
            raise SpecError(f"{key}.parameters", f"not a valid JSON schema: {e.message}") from None
        if parameters.get("type") != "object":
            raise SpecError(f"{key}.parameters", "must be a JSON schema with type 'object' (the arguments object)")
        leaked = sorted(set(parameters.get("properties", {})) & set(bind))
        if leaked:
            raise SpecError(f"{key}.parameters", f"bound parameters {leaked} must not be in the model's schema")
    name = spec.get("name") or ref.function
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
        raise SpecError(f"{key}.name", f"tool names are letters, digits, '_', '.', '-' (<= 64), got {name!r}")
    description = spec.get("description") or sig.description or f"The {name} tool."
    tool = ConfigTool(name, description, parameters, bind, float(spec.get("timeout_s", 5.0)), untrusted, ref, fn,
                      sig.positional_only, int(spec.get("memory_mb", 256)))
    if untrusted:  # load it once in the sandbox: a file that cannot import there fails now, not mid-run
        try:
            sandbox_call(ref, "probe", {}, SandboxSettings(max(tool.timeout_s, 10.0), tool.memory_mb))
        except (SandboxFailure, ToolError) as e:
            raise SpecError(f"{key}.function", f"{ref.text} does not load in the sandbox (standard library only): "
                                               f"{e}") from None
    return tool


class Workdir:
    """A temporary directory made on first use and removed by ``close()`` or garbage collection."""

    def __init__(self, prefix: str = "marathon-tools-") -> None:
        self.prefix = prefix
        self.path: Path | None = None
        self._finalizer: weakref.finalize | None = None

    def __call__(self) -> Path:
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix=self.prefix))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        return self.path

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.path, self._finalizer = None, None


__all__ = ["ConfigTool", "FunctionRef", "SandboxFailure", "SandboxSettings", "SpecError", "Workdir", "build_tool",
           "call_check", "find_function", "import_function", "sandbox_call", "signature_from_callable",
           "signature_from_source"]
