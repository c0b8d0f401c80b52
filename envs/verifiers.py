"""Answer checks named in a config: built-ins or ``module:function``; their verdict is ``info["success"]``.

A spec is a built-in's name (``verifier: numeric``) or a mapping::

    verifier: {type: numeric, tolerance: 1.0e-6, rel_tolerance: 0.0}  # first number of the answer vs the truth
    verifier: {type: exact, case_sensitive: true}        # the answer equals str(truth) (surrounding space ignored)
    verifier: {type: normalized}                         # equal after lower-casing, dropping punctuation and
                                                         # articles (a, an, the), collapsing whitespace
    verifier: {type: regex, pattern: null, fullmatch: true, ignore_case: false}
                                                         # the answer matches `pattern`, or the truth as a pattern
    verifier: {type: python, code: "def check(answer, truth, row): ..."}   # run in the code sandbox
    verifier: {function: my_pkg.checks:check, params: {...}}               # imported, called in-process
    verifier: {function: checks.py:check, untrusted: true}                 # its file runs in the code sandbox

A truth that is a list accepts any of its items (exact, normalized, numeric, regex). A function is called as
``check(answer, truth, row=row, **params)`` (``row``, the whole task row, only if it takes a ``row`` parameter
or ``**kwargs``) and returns a bool, or a number: ``success = value >= threshold`` (default 1.0), the number
is ``info["score"]``. A check that raises, times out (``timeout_s``, default 10) or returns anything else
raises ``VerifierError``; the dataset env turns that into an infrastructure-failed episode.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envs.config_tools import (
    FunctionRef,
    SandboxFailure,
    SandboxSettings,
    SpecError,
    call_check,
    find_function,
    import_function,
    sandbox_call,
)
from envs.parsing import first_number
from envs.tools import ToolError

BUILTINS = ("exact", "normalized", "numeric", "regex", "python")
_OPTIONS = {  # options that belong to one built-in only
    "tolerance": "numeric", "rel_tolerance": "numeric", "pattern": "regex", "fullmatch": "regex",
    "ignore_case": "regex", "case_sensitive": "exact", "code": "python",
}


class VerifierError(Exception):
    """A check that could not give a verdict: ``str()`` says why, ``traceback`` has the detail."""

    def __init__(self, message: str, traceback: str = "", kind: str = "verifier_error") -> None:
        super().__init__(message)
        self.traceback, self.kind = traceback, kind


class VerifierSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["exact", "normalized", "numeric", "regex", "python"] | None = None
    function: str | None = None
    untrusted: bool = False
    params: dict[str, Any] = Field(default_factory=dict)
    threshold: float = 1.0
    timeout_s: float = Field(10.0, gt=0)
    memory_mb: int = Field(256, ge=32)
    tolerance: float = Field(1e-6, ge=0)
    rel_tolerance: float = Field(0.0, ge=0)
    pattern: str | None = None
    fullmatch: bool = True
    ignore_case: bool = False
    case_sensitive: bool = True
    code: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "VerifierSpec":
        if (self.type is None) == (self.function is None):
            raise ValueError("give either 'type' (one of " + ", ".join(BUILTINS) + ") or 'function: module:function'")
        kind = self.type or "function"
        for option, owner in _OPTIONS.items():
            if option in self.model_fields_set and owner != kind:
                raise ValueError(f"'{option}' applies to type {owner} only (this verifier is {kind})")
        if self.type == "python" and not self.code:
            raise ValueError("type python needs 'code' defining check(answer, truth, row)")
        if self.untrusted and self.function is None:
            raise ValueError("'untrusted' applies to 'function' verifiers (type python always runs in the sandbox)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {e}") from None
        return self


def parse_spec(data: Any, key: str) -> VerifierSpec:
    if isinstance(data, str):
        if data not in BUILTINS:
            raise SpecError(key, f"unknown verifier {data!r}; built-ins: {', '.join(BUILTINS)} (or a mapping with "
                                 "'function: module:function')")
        data = {"type": data}
    if not isinstance(data, dict):
        raise SpecError(key, f"expected a built-in's name or a mapping, got {type(data).__name__}")
    try:
        return VerifierSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise SpecError(f"{key}.{where}" if where else key, msg) from None


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, articles dropped, whitespace collapsed (SQuAD-style)."""
    text = "".join(" " if unicodedata.category(c).startswith("P") or c in string.punctuation else c
                   for c in str(text).lower())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            x = float(value.strip().replace(",", ""))
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


def _options(truth: Any) -> list[Any]:
    return list(truth) if isinstance(truth, (list, tuple)) else [truth]


@dataclass
class Verifier:
    """A resolved verifier: ``verify(answer, truth, row) -> (success, score)``."""

    spec: VerifierSpec
    name: str
    fn: Callable[..., Any] | None = None  # trusted function
    ref: FunctionRef | None = None  # sandboxed code or file

    # -- up-front checks ------------------------------------------------------------------------------------
    def truth_problem(self, truth: Any) -> str | None:
        """What is wrong with a row's ground truth for this verifier (None: nothing)."""
        kind = self.spec.type
        if truth is None:
            return "the ground truth is missing (null)"
        if kind in ("exact", "normalized", "numeric", "regex"):
            items = _options(truth)
            if not items:
                return "the ground truth is an empty list"
            for t in items:
                if isinstance(t, (dict, list)):
                    return f"the ground truth must be text or a number (or a list of them), got {type(t).__name__}"
            if kind == "numeric":
                bad = [t for t in items if _number(t) is None]
                if bad:
                    return f"the numeric verifier needs a number as ground truth, got {bad[0]!r}"
            if kind == "regex" and self.spec.pattern is None:
                for t in items:
                    try:
                        re.compile(str(t))
                    except re.error as e:
                        return f"the ground truth {t!r} is not a valid regular expression ({e})"
        return None

    # -- the verdict ----------------------------------------------------------------------------------------
    def _builtin(self, answer: str, truth: Any) -> bool:
        s = self.spec
        items = _options(truth)
        if s.type == "exact":
            a = answer.strip()
            return any((a == str(t).strip()) if s.case_sensitive else (a.lower() == str(t).strip().lower())
                       for t in items)
        if s.type == "normalized":
            a = normalize(answer)
            return any(a == normalize(str(t)) for t in items)
        if s.type == "numeric":
            value = first_number(answer)
            if value is None:
                return False
            return any(abs(value - _number(t)) <= max(s.tolerance, s.rel_tolerance * abs(_number(t))) for t in items)
        flags = re.IGNORECASE if s.ignore_case else 0
        patterns = [s.pattern] if s.pattern is not None else [str(t) for t in items]
        match = re.fullmatch if s.fullmatch else re.search
        return any(match(p, answer.strip(), flags) is not None for p in patterns)

    def _call(self, answer: str, truth: Any, row: dict[str, Any]) -> Any:
        if self.ref is not None:
            payload = {"answer": answer, "truth": truth, "row": row, "params": self.spec.params}
            settings = SandboxSettings(self.spec.timeout_s, self.spec.memory_mb)
            try:
                return sandbox_call(self.ref, "check", payload, settings)
            except SandboxFailure as e:
                raise VerifierError(f"verifier {self.name} raised {e}", e.traceback) from None
            except ToolError as e:  # ToolTimeout included: the sandbox's time limit
                kind = "verifier_timeout" if "timed out" in str(e) else "verifier_error"
                raise VerifierError(f"verifier {self.name}: {e}", kind=kind) from None
        from envs.guard import call_limited  # a hung check is abandoned (and counted) like a hung env call

        out = call_limited(call_check, (self.fn, answer, truth, row, self.spec.params),
                           timeout_s=self.spec.timeout_s, name=f"verifier-{self.name}")
        if out.timed_out:
            raise VerifierError(f"verifier {self.name} did not return within {self.spec.timeout_s:g} s (at "
                                f"{out.where})", out.traceback, kind="verifier_timeout")
        if out.error is not None:
            e = out.error
            raise VerifierError(f"verifier {self.name} raised {type(e).__name__}: {e}", out.traceback)
        return out.value

    def verify(self, answer: str, truth: Any, row: dict[str, Any]) -> tuple[bool, float | None]:
        """``(success, score)``; ``score`` is set when the check returned a number."""
        if self.spec.type in ("exact", "normalized", "numeric", "regex"):
            try:
                return self._builtin(answer, truth), None
            except Exception as e:  # noqa: BLE001 - a truth the up-front check missed
                raise VerifierError(f"verifier {self.name} raised {type(e).__name__}: {e}") from None
        value = self._call(answer, truth, row)
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return bool(value), None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value) >= self.spec.threshold, float(value)
        raise VerifierError(f"verifier {self.name} returned {value!r} ({type(value).__name__}); expected a bool "
                            "or a finite number")


def build_verifier(data: Any, key: str) -> Verifier:
    """Resolve a verifier spec; everything wrong with it raises ``SpecError`` naming ``key``."""
    spec = parse_spec(data, key)
    if spec.type == "python":
        try:
            compile(spec.code, "<verifier code>", "exec")
        except SyntaxError as e:
            raise SpecError(f"{key}.code", f"does not parse: {e.msg} (line {e.lineno})") from None
        ref = FunctionRef(f"{key}.code", "<verifier code>", "check", None, spec.code)
        verifier = Verifier(spec, "python (sandboxed code)", ref=ref)
    elif spec.type is not None:
        return Verifier(spec, spec.type)
    elif spec.untrusted:
        ref = find_function(spec.function, f"{key}.function", untrusted=True)
        verifier = Verifier(spec, f"{spec.function} (sandboxed)", ref=ref)
    else:
        ref = find_function(spec.function, f"{key}.function")
        return Verifier(spec, spec.function, fn=import_function(ref, f"{key}.function"))
    where = f"{key}.code" if spec.type == "python" else f"{key}.function"
    try:
        sandbox_call(verifier.ref, "probe", {}, SandboxSettings(max(spec.timeout_s, 10.0), spec.memory_mb))
    except (SandboxFailure, ToolError) as e:
        raise SpecError(where, f"does not load in the sandbox (standard library only): {e}") from None
    return verifier
