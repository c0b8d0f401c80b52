"""Reward config files: named, weighted reward terms (format: ``rewards/README.md``).

``load_reward_config(path)`` parses and validates a YAML file into a ``RewardConfig``; any problem raises one
``RewardConfigError`` naming the file, the key and what was expected. ``RewardConfig.score`` is model-free:
it takes the episode's last ``info`` and two counts; a term that raises or returns something other than a
finite number raises ``RewardTermError`` naming the term (the driver then marks that episode as an infra
failure and leaves it out of the update, ``rewards/README.md``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import traceback
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from rewards.terms import BUILTIN_TERMS

DEFAULT_PATH = Path(str(resources.files("rewards") / "default.yaml"))
Weight = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class RewardConfigError(ValueError):
    """A broken reward config: ``source: key: problem``."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


class RewardTermError(ValueError):
    """A reward term failed on one episode: it raised, or returned NaN, inf or a non-number."""

    def __init__(self, term: str, message: str, tb: str = "") -> None:
        self.term, self.traceback = term, tb
        super().__init__(message)


class TermSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    weight: Weight
    function: str | None = None  # "module:function" for a custom term; absent for a built-in one
    params: dict[str, Any] = Field(default_factory=dict)


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    terms: dict[str, TermSpec] = Field(min_length=1)
    description: str = ""
    _fns: dict[str, Callable[..., float]] = PrivateAttr(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<reward config>") -> RewardConfig:
        """Validate ``data`` (the parsed YAML) and resolve every term's function."""
        if not isinstance(data, dict):
            raise RewardConfigError(source, "", f"expected a mapping with key 'terms', got {type(data).__name__}")
        try:
            config = cls.model_validate(data)
        except ValidationError as e:
            raise _first_error(e, source) from None
        for name, spec in config.terms.items():
            config._fns[name] = _resolve(name, spec, source)
        return config

    def score(self, info: dict[str, Any], num_model_tokens: int, num_turns: int) -> tuple[float, dict[str, float]]:
        """``(total, {term: weight * value})`` for one finished episode; ``total`` is the sum of the terms."""
        terms = {}
        for name, spec in self.terms.items():
            fn = spec.function or name
            try:
                value = self._fns[name](info, num_model_tokens, num_turns, **spec.params)
            except Exception as e:  # noqa: BLE001 - named and passed on
                raise RewardTermError(name, f"reward term {name!r} ({fn}) raised {type(e).__name__}: {e}",
                                      traceback.format_exc()) from e
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardTermError(name, f"reward term {name!r} returned {value!r}; expected a finite number "
                                            f"(function {fn})")
            terms[name] = spec.weight * float(value)
            if not math.isfinite(terms[name]):
                raise RewardTermError(name, f"reward term {name!r}: weight {spec.weight!r} x {value!r} overflows")
        total = sum(terms.values())
        if not math.isfinite(total):
            raise RewardTermError(next(iter(terms)), f"the reward terms {terms} sum to {total}")
        return total, terms


def _first_error(e: ValidationError, source: str, model: type[BaseModel] | None = None) -> RewardConfigError:
    """One error for the file: unknown keys first (a misspelt key also shows up as a missing one)."""
    err = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return RewardConfigError(source, key, "missing required key")
    if err["type"] == "extra_forbidden":
        model = model or (TermSpec if len(err["loc"]) == 3 else RewardConfig)
        return RewardConfigError(source, key, f"unknown key; allowed keys: {', '.join(model.model_fields) or '(none)'}")
    return RewardConfigError(source, key, f"{err['msg'][0].lower()}{err['msg'][1:]} (got {err['input']!r})")


def _resolve(name: str, spec: TermSpec, source: str) -> Callable[..., float]:
    key = f"terms.{name}"
    if name in BUILTIN_TERMS:
        if spec.function is not None:
            raise RewardConfigError(source, f"{key}.function", f"{name!r} is a built-in term; give a custom term another name")
        fn, params_model = BUILTIN_TERMS[name]
        try:
            params_model.model_validate(spec.params)
        except ValidationError as e:
            inner = _first_error(e, source, params_model)
            raise RewardConfigError(source, f"{key}.params.{inner.key}", inner.problem) from None
        return fn
    if spec.function is None:
        raise RewardConfigError(
            source, key, f"unknown term {name!r}; built-in terms: {', '.join(BUILTIN_TERMS)} "
            "(a custom term needs 'function: module:function')"
        )
    module_name, sep, attr = spec.function.partition(":")
    if not sep or not module_name or not attr:
        raise RewardConfigError(source, f"{key}.function", f"expected 'module:function', got {spec.function!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config error
        raise RewardConfigError(source, f"{key}.function", f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RewardConfigError(source, f"{key}.function", f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardConfigError(source, f"{key}.function", f"{spec.function!r} is not callable ({type(fn).__name__})")
    try:
        inspect.signature(fn).bind({}, 0, 0, **spec.params)
    except TypeError as e:
        raise RewardConfigError(
            source, f"{key}.params",
            f"{spec.function} cannot be called as f(info, num_model_tokens, num_turns, **params): {e}",
        ) from None
    except ValueError:  # no signature (some builtins); checked when first called
        pass
    return fn


def load_reward_config(path: str | Path = DEFAULT_PATH) -> RewardConfig:
    """Load and validate a reward config YAML file (default: ``rewards/default.yaml``)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise RewardConfigError(source, "", f"cannot read file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RewardConfigError(source, "", f"invalid YAML: not UTF-8 text (byte {e.start})") from None
    except ValueError as e:  # e.g. a NUL in the path
        raise RewardConfigError(source, "", f"cannot read file: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RewardConfigError(source, "", f"invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise RewardConfigError(source, "", "invalid YAML: nested too deeply") from None
    return RewardConfig.from_dict(data, source)
