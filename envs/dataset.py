"""``marathon/Dataset-v0``: tasks are the rows of a dataset; tools and the answer check come from the config.

No env class to write: point a run config at a file of tasks::

    env:
      id: marathon/Dataset-v0
      kwargs:
        data: examples/own_tasks/tasks.jsonl   # .jsonl/.json, .parquet, .csv, a save_to_disk folder, or a hub name
        prompt_template: "What is {name}'s phone extension?"   # or messages_column / prompt_column
        system_prompt: "Use the lookup tool, then reply: Final answer: <number>"
        answer_column: answer                  # the ground truth the verifier gets
        heldout: {column: split, values: [test]}   # or {data: file}, {split: test}, {fraction: 0.1}
        tools:
          - function: examples/own_tasks/tools.py:lookup   # or my_pkg.tools:lookup, or entry_point: NAME
            bind: {directory: directory}       # the row's column 'directory' fills the hidden parameter
        verifier: numeric                      # or {type: ..., ...} / {function: module:function} (envs/verifiers.py)

**Prompt** (the reset observation's messages), from the first of: ``prompt_template`` (``str.format`` over the
row's columns, one user message); ``messages_column`` (a list of ``{role, content}`` with roles system/user;
a JSON string in CSV files); ``prompt_column`` (a string, one user message); by default the column
``messages``, else ``prompt``. ``system_prompt`` is put first unless the messages start with a system one.

**Seeds -> rows**: training seeds (``envs.train_seeds``) index the training rows, shuffled per pass over
them (``shuffle_seed``; ``shuffle: false`` keeps file order); held-out seeds (``envs.heldout_seeds``) index
the held-out rows in order (seed ``10**9 + k`` is held-out row ``k mod n``). The same seed is always the
same row. ``reset(options={"split": "train"|"heldout", "index": k})`` picks a row directly.

**Held-out split** (``heldout``, one of): ``{column: NAME, values: [test]}`` rows whose column holds one of
the values; ``{data: FILE}`` a second file; ``{split: NAME}`` another split of a folder/hub dataset;
``{fraction: 0.1}`` (the default; a bare number works too) a hashed fraction: a row is held out when the hash
of the task (prompt, the row values bound to tools, ground truth; or ``key_column``) falls under the
fraction, so one task is never in both splits. ``marathon env check`` reports tasks found in both splits.

**Reference solutions** (``reference_column``, default ``reference`` when the data has it): a final answer
(text or number), or a list of assistant turns (strings, or messages with ``content`` and/or OpenAI-style
``tool_calls``; other roles are skipped). The env's ``oracle_action`` replays them (the tools really run), so
the SFT warm start (``marathon/demos.py``) and ``marathon env check`` use them. Without any reference the
env has no ``oracle_action`` and ``prepare`` says that SFT needs them.

**Errors**: everything checkable is checked when the env is made, once per config and process (cached):
the file loads, every row of both splits has a usable prompt, ground truth (for the verifier) and reference,
bound columns exist, tools import and have valid schemas, the verifier resolves and runs on a few rows. Each
problem is one ``SpecError`` (a ``ValueError``) naming the key (``env.kwargs.tools[0].function``) and, for
data, the file and row (``tasks.jsonl line 7``). A verifier that fails mid-run (raises, times out, returns a
non-verdict) ends the episode with ``success`` False and ``info["infra_failure"]`` in ``envs.guard``'s format
(``{"kind": "exception" | "timeout", "call": "step", "message", "traceback", "source": "verifier"}``: the
rollout counts the episode as an env fault, not as a failure of the policy); its error is also the terminal
observation's one tool message.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envs.base import ToolEnv
from envs.config_tools import ConfigTool, SpecError, Workdir, build_tool
from envs.guard import failure_info
from envs.parsing import format_call, parse_turn
from envs.seeds import HELDOUT_START, is_heldout
from envs.verifiers import Verifier, VerifierError, build_verifier

KEY = "env.kwargs"
JSON_LINES = (".jsonl", ".ndjson")
FILE_SUFFIXES = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
VERIFY_UP_FRONT = 3  # rows the verifier runs on when the env is made (more in `marathon env check`)
Split = Literal["train", "heldout"]


# -- the kwargs ------------------------------------------------------------------------------------------------
class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolSpec(_Spec):
    function: str | None = None  # "module:function" or "path/to/file.py:function"
    entry_point: str | None = None  # a name in the "marathon.tools" entry-point group
    name: str | None = None  # default: the function's name
    description: str | None = None  # default: the docstring's first paragraph
    parameters: dict[str, Any] | None = None  # default: from the signature and docstring
    bind: dict[str, str] = Field(default_factory=dict)  # parameter -> column of the task row (hidden from the model)
    untrusted: bool = False  # run the function's file in the code sandbox
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(256, ge=32)  # sandbox memory limit (untrusted only)

    @model_validator(mode="after")
    def _one_source(self) -> "ToolSpec":
        if (self.function is None) == (self.entry_point is None):
            raise ValueError("give either 'function: module:function' or 'entry_point: NAME'")
        return self


class HeldoutSpec(_Spec):
    column: str | None = None
    values: list[Any] | None = None  # with column (default: ["test"])
    data: str | None = None
    split: str | None = None  # alone: another split of `data`'s source; with data: that file's split
    fraction: float | None = Field(None, gt=0, lt=1)
    key_column: str | None = None  # with fraction: hash this column instead of the prompt

    @model_validator(mode="after")
    def _one_kind(self) -> "HeldoutSpec":
        kinds = [k for k in ("column", "data", "fraction") if getattr(self, k) is not None]
        if not kinds and self.split is not None:
            kinds = ["split"]
        if len(kinds) != 1:
            raise ValueError("give exactly one of column (+ values), data (a second file), split, fraction")
        if self.values is not None and self.column is None:
            raise ValueError("'values' goes with 'column'")
        if self.key_column is not None and self.fraction is None:
            raise ValueError("'key_column' goes with 'fraction'")
        return self

    @property
    def kind(self) -> str:
        for k in ("column", "data", "fraction"):
            if getattr(self, k) is not None:
                return k
        return "split"


class DatasetConfig(_Spec):
    data: str
    split: str = "train"  # for a folder or hub dataset with several splits
    prompt_template: str | None = None
    messages_column: str | None = None
    prompt_column: str | None = None
    system_prompt: str | None = None
    answer_column: str = "answer"
    reference_column: str | None = None
    heldout: HeldoutSpec | float = Field(default_factory=lambda: HeldoutSpec(fraction=0.1))
    tools: list[ToolSpec] = Field(default_factory=list)
    verifier: Any = "exact"
    shuffle: bool = True
    shuffle_seed: int = 0
    max_turns: int = Field(4, ge=1)
    max_calls_per_turn: int = Field(8, ge=1)
    max_observation_chars: int = Field(4096, ge=64)

    @model_validator(mode="after")
    def _prompt_source(self) -> "DatasetConfig":
        given = [k for k in ("prompt_template", "messages_column", "prompt_column") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one prompt source, not {given}")
        return self

    @field_validator("heldout")
    @classmethod
    def _fraction(cls, v: HeldoutSpec | float) -> HeldoutSpec:
        if isinstance(v, HeldoutSpec):
            return v
        if not 0 < v < 1:
            raise ValueError(f"a number is a fraction of the rows, in (0, 1); got {v}")
        return HeldoutSpec(fraction=v)


def parse_kwargs(kwargs: dict[str, Any]) -> DatasetConfig:
    try:
        return DatasetConfig.model_validate(kwargs)
    except ValidationError as e:
        errs = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")
        err = errs[0]
        # union branches show up in the location ("function-after[_one_kind(), HeldoutSpec]", "float"): drop them
        parts = [p for p in err["loc"] if isinstance(p, int) or ("[" not in p and p != "float")]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            model = {1: DatasetConfig}.get(len(parts)) or {"tools": ToolSpec, "heldout": HeldoutSpec}.get(parts[0])
            known = sorted(model.model_fields) if model else None
            msg = "unknown option" + (f"; known: {', '.join(known)}" if known else "")
        elif err["type"] == "missing":
            msg = "missing (required)"
        raise SpecError(f"{KEY}{loc}", msg) from None


# -- loading ---------------------------------------------------------------------------------------------------
@dataclass
class Source:
    """One loaded table: its rows and how to name a row in messages."""

    name: str  # the file / folder / hub name, as given
    table: Any  # datasets.Dataset
    lines: list[int] | None = None  # JSON lines: the file line of each row
    has_splits: bool = False  # one split of a folder / hub dataset with several

    def label(self, i: int) -> str:
        return f"{self.name} line {self.lines[i]}" if self.lines is not None else f"{self.name} row {i}"

    def __len__(self) -> int:
        return len(self.table)


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _read_json(path: Path, key: str) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Rows of a JSON-lines file (or a .json list), each a JSON object; errors name the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(key, f"{path}: not UTF-8 text ({e})") from None
    rows, lines = [], []
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(key, f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise SpecError(key, f"{path} row {i}: expected a JSON object per task, got {_kind_of(row)}")
        return data, None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(key, f"{path} line {n}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise SpecError(key, f"{path} line {n}: expected a JSON object per task, got {_kind_of(row)}")
        rows.append(row)
        lines.append(n)
    return rows, lines


def _check_column_types(rows: list[dict[str, Any]], label) -> None:
    """A column must hold one kind of value (Arrow tables are typed); names the first row that breaks it."""
    first: dict[str, tuple[str, int]] = {}
    for i, row in enumerate(rows):
        for col, value in row.items():
            if value is None:
                continue
            kind = _kind_of(value)
            if col not in first:
                first[col] = (kind, i)
            elif first[col][0] != kind:
                raise ValueError(f"{label(i)}: column {col!r} holds {kind} here but {first[col][0]} in "
                                 f"{label(first[col][1])} (a column holds one type of value)")


def _quiet_datasets():
    import datasets

    class _Quiet:
        def __enter__(self):
            self.was = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()

        def __exit__(self, *exc):
            if self.was:
                datasets.enable_progress_bars()

    return _Quiet()


def load_source(data: str, split: str, key: str) -> Source:
    """Load ``data`` with ``datasets``: a file, a ``save_to_disk`` folder, or a hub dataset name."""
    import datasets

    path = Path(data)
    with _quiet_datasets():
        if path.is_file():
            fmt = FILE_SUFFIXES.get(path.suffix.lower())
            if fmt is None:
                raise SpecError(key, f"{data}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
            try:
                if fmt == "json":
                    rows, lines = _read_json(path, key)
                    src = Source(data, None, lines)
                    _check_column_types(rows, src.label)
                    src.table = datasets.Dataset.from_list(rows)
                    return src
                reader = datasets.Dataset.from_parquet if fmt == "parquet" else datasets.Dataset.from_csv
                return Source(data, reader(str(path), keep_in_memory=True))
            except SpecError:
                raise
            except ValueError as e:
                raise SpecError(key, str(e)) from None
            except Exception as e:  # noqa: BLE001 - pyarrow/datasets errors: one message naming the file
                raise SpecError(key, f"{data}: could not load it with datasets ({type(e).__name__}: {e})") from None
        if path.is_dir():
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as e:  # noqa: BLE001
                raise SpecError(key, f"{data}: a folder, but not one written by datasets' save_to_disk "
                                     f"({type(e).__name__}: {e})") from None
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise SpecError(key, f"{data}: no split {split!r}; splits: {sorted(loaded)}")
                return Source(f"{data}[{split}]", loaded[split], has_splits=True)
            return Source(data, loaded)
        if path.suffix.lower() in FILE_SUFFIXES or data.startswith((".", "/")) or data.count("/") > 1:
            raise SpecError(key, f"{data}: no such file (relative paths are from the working directory {Path.cwd()})")
        try:  # a hub dataset name, where the machine can reach a hub
            return Source(f"{data}[{split}]", datasets.load_dataset(data, split=split), has_splits=True)
        except Exception as e:  # noqa: BLE001
            raise SpecError(key, f"{data}: not a file or folder here (working directory {Path.cwd()}), and loading it "
                                 f"from the hub failed ({type(e).__name__}: {str(e)[:300]})") from None


def _stamp(data: str) -> Any:
    """Identity of a local file/folder's content for the cache key (size and mtime)."""
    p = Path(data)
    try:
        if p.is_dir():
            return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.rglob("*") if f.is_file())
        st = p.stat()
        return (st.st_size, st.st_mtime_ns)
    except OSError:
        return None


# -- rows --------------------------------------------------------------------------------------------------------
def _assistant_turns(reference: Any) -> list[str] | str:
    """The assistant turns of a reference solution, or a problem (str) with it."""
    if isinstance(reference, bool) or isinstance(reference, (dict,)):
        return f"expected a final answer or a list of assistant turns, got {_kind_of(reference)}"
    if isinstance(reference, (str, int, float)):
        text = str(reference).strip()
        if not text:
            return "the reference answer is empty"
        if isinstance(reference, float) and not math.isfinite(reference):
            return f"the reference answer is {reference}"
        return [f"Final answer: {text}"]
    if not isinstance(reference, list):
        return f"expected a final answer or a list of assistant turns, got {_kind_of(reference)}"
    turns = []
    for j, m in enumerate(reference):
        if isinstance(m, str):
            turns.append(m)
            continue
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"item {j}: expected a string or a message with 'role', got {_kind_of(m)}"
        if m["role"] != "assistant":
            continue
        text = m.get("content") or ""
        if not isinstance(text, str):
            return f"item {j}: 'content' must be text, got {_kind_of(text)}"
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return f"item {j}: each tool call needs function.name"
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    return f"item {j}: tool call {fn['name']!r}: arguments are not valid JSON ({e.msg})"
            if args is None:
                args = {}
            if not isinstance(args, dict):
                return f"item {j}: tool call {fn['name']!r}: arguments must be an object"
            # Arrow fills keys other rows have with None: drop them
            text += format_call(fn["name"], {k: v for k, v in args.items() if v is not None})
        if not text:
            return f"item {j}: an assistant message with neither content nor tool_calls"
        turns.append(text)
    if not turns:
        return "no assistant turn in the reference messages"
    if parse_turn(turns[-1]).answer is None:
        return "the last assistant turn of the reference is a tool call, not a final answer"
    return turns


def _messages_of(value: Any) -> list[dict[str, str]] | str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return "expected a list of {role, content} messages (or its JSON text), got text that is not JSON"
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of {{role, content}} messages, got {_kind_of(value)}"
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            return f"message {j}: expected {{role, content}}, got {_kind_of(m)}"
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user"):
            return f"message {j}: role must be 'system' or 'user' (the task's opening), got {role!r}"
        if not isinstance(content, str):
            return f"message {j}: content must be text, got {_kind_of(content)}"
        out.append({"role": role, "content": content})
    return out


@dataclass
class TaskSet:
    """A validated config: rows of both splits, tools and verifier (shared by every env made from it)."""

    cfg: DatasetConfig
    columns: list[str]
    train: tuple[Source, np.ndarray]  # (source, row indices)
    heldout: tuple[Source, np.ndarray]
    tools: list[ConfigTool]
    verifier: Verifier
    prompt_mode: str  # "template", "messages:<col>" or "prompt:<col>"
    reference_column: str | None
    references: dict[str, int] = field(default_factory=dict)  # split -> rows with a reference
    _perms: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- rows -------------------------------------------------------------------------------------------------
    def split(self, which: Split) -> tuple[Source, np.ndarray]:
        return self.train if which == "train" else self.heldout

    def size(self, which: Split) -> int:
        return len(self.split(which)[1])

    def row(self, which: Split, k: int) -> tuple[dict[str, Any], str]:
        src, idx = self.split(which)
        i = int(idx[k])
        return src.table[i], src.label(i)

    def locate(self, seed: int) -> tuple[Split, int]:
        """The split and position of the row a seed names."""
        if is_heldout(seed):
            return "heldout", (seed - HELDOUT_START) % self.size("heldout")
        n = self.size("train")
        epoch, k = divmod(seed, n)
        if not self.cfg.shuffle:
            return "train", k
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.cfg.shuffle_seed, epoch]).permutation(n)
                self._perms[epoch] = perm
                while len(self._perms) > 4:
                    self._perms.popitem(last=False)
            else:
                self._perms.move_to_end(epoch)
        return "train", int(perm[k])

    # -- what a row gives ---------------------------------------------------------------------------------------
    def prompt(self, row: dict[str, Any]) -> list[dict[str, str]]:
        cfg = self.cfg
        kind, _, col = self.prompt_mode.partition(":")
        if kind == "template":
            msgs = [{"role": "user", "content": cfg.prompt_template.format_map(row)}]
        elif kind == "messages":
            msgs = _messages_of(row[col])
        else:
            msgs = [{"role": "user", "content": row[col]}]
        if cfg.system_prompt is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": cfg.system_prompt}, *msgs]
        return msgs

    def reference_turns(self, row: dict[str, Any]) -> list[str] | None:
        ref = row.get(self.reference_column) if self.reference_column else None
        if ref is None or (isinstance(ref, (list, str)) and len(ref) == 0):
            return None
        turns = _assistant_turns(ref)
        return turns if isinstance(turns, list) else None

    def row_problem(self, row: dict[str, Any]) -> str | None:
        """What makes a row unusable (None: nothing)."""
        kind, _, col = self.prompt_mode.partition(":")
        if kind == "template":
            try:
                text = self.cfg.prompt_template.format_map(row)
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
                return f"prompt_template cannot be filled from this row ({type(e).__name__}: {e})"
            if not text.strip():
                return "the prompt_template gives an empty prompt"
        elif kind == "messages":
            msgs = _messages_of(row[col])
            if isinstance(msgs, str):
                return f"column {col!r}: {msgs}"
        elif not isinstance(row[col], str) or not row[col].strip():
            return f"column {col!r}: expected the prompt as non-empty text, got {row[col]!r:.80}"
        problem = self.verifier.truth_problem(row[self.cfg.answer_column])
        if problem:
            return f"column {self.cfg.answer_column!r}: {problem}"
        ref = row.get(self.reference_column) if self.reference_column else None
        if ref is not None and not (isinstance(ref, (list, str)) and len(ref) == 0):
            turns = _assistant_turns(ref)
            if isinstance(turns, str):
                return f"column {self.reference_column!r} (reference solution): {turns}"
        return None

    def identity(self, row: dict[str, Any]) -> str:
        """What makes a task this task: its prompt, the row values its tools see, its ground truth."""
        bound = {c: row.get(c) for t in self.tools for c in sorted(t.bind.values())}
        return json.dumps([self.prompt(row), bound, row[self.cfg.answer_column]], sort_keys=True, default=str)

    def fingerprint(self, row: dict[str, Any]) -> str:
        return hashlib.sha1(self.identity(row).encode()).hexdigest()


def _template_fields(template: str) -> list[str]:
    out = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise SpecError(f"{KEY}.prompt_template", f"fields must name columns ({{column}}), got {{{name}}}")
        out.append(root)
    return out


def _prompt_mode(cfg: DatasetConfig, columns: list[str], data: str) -> str:
    if cfg.prompt_template is not None:
        try:
            fields = _template_fields(cfg.prompt_template)
        except ValueError as e:
            if isinstance(e, SpecError):
                raise
            raise SpecError(f"{KEY}.prompt_template", f"not a valid format string: {e}") from None
        missing = [f for f in fields if f not in columns]
        if missing:
            raise SpecError(f"{KEY}.prompt_template",
                            f"field(s) {missing} are not columns of {data}; columns: {columns}")
        return "template"
    for key, col, kind in (("messages_column", cfg.messages_column, "messages"),
                           ("prompt_column", cfg.prompt_column, "prompt")):
        if col is not None:
            if col not in columns:
                raise SpecError(f"{KEY}.{key}", f"column {col!r} not found in {data}; columns: {columns}")
            return f"{kind}:{col}"
    for col, kind in (("messages", "messages"), ("prompt", "prompt")):
        if col in columns:
            return f"{kind}:{col}"
    raise SpecError(KEY, f"{data} has no 'messages' or 'prompt' column (columns: {columns}); name the prompt with "
                         "messages_column, prompt_column or prompt_template")


def _split_rows(cfg: DatasetConfig, main: Source, keys: list[str] | None
                ) -> tuple[tuple[Source, np.ndarray], tuple[Source, np.ndarray]]:
    h: HeldoutSpec = cfg.heldout
    n = len(main)
    everything = np.arange(n)
    if h.kind == "data":
        other = load_source(h.data, h.split or cfg.split, f"{KEY}.heldout.data")
        return (main, everything), (other, np.arange(len(other)))
    if h.kind == "split":
        if not main.has_splits:
            raise SpecError(f"{KEY}.heldout.split", f"{cfg.data} has no splits (a single file); use heldout.column, "
                                                    "heldout.data or heldout.fraction")
        other = load_source(cfg.data, h.split, f"{KEY}.heldout.split")
        return (main, everything), (other, np.arange(len(other)))
    if h.kind == "column":
        if h.column not in main.table.column_names:
            raise SpecError(f"{KEY}.heldout.column", f"column {h.column!r} not found in {main.name}; columns: "
                                                     f"{main.table.column_names}")
        values = h.values if h.values is not None else ["test"]
        wanted = {json.dumps(v) for v in values} | {str(v) for v in values}
        col = _column(main.table, h.column)
        held = np.array([v is not None and (json.dumps(v, default=str) in wanted or str(v) in wanted) for v in col],
                        dtype=bool)
    else:
        held = np.array([int(hashlib.sha1(k.encode()).hexdigest()[:15], 16) / 16**15 < h.fraction for k in keys],
                        dtype=bool)
    return (main, everything[~held]), (main, everything[held])


def _column(table: Any, name: str) -> list[Any]:
    """A whole column as Python values (through Arrow: iterating a ``datasets`` column goes row by row)."""
    return table.with_format("arrow")[name].to_pylist()


def _iter_rows(table: Any, batch: int = 1024):
    for start in range(0, len(table), batch):
        chunk = table[start:start + batch]
        cols = list(chunk)
        for j in range(len(chunk[cols[0]]) if cols else 0):
            yield start + j, {c: chunk[c][j] for c in cols}


def build_taskset(cfg: DatasetConfig) -> TaskSet:
    main = load_source(cfg.data, cfg.split, f"{KEY}.data")
    columns = list(main.table.column_names)
    if len(main) == 0:
        raise SpecError(f"{KEY}.data", f"{main.name} holds no rows")
    prompt_mode = _prompt_mode(cfg, columns, main.name)
    if cfg.answer_column not in columns:
        raise SpecError(f"{KEY}.answer_column", f"column {cfg.answer_column!r} not found in {main.name}; columns: "
                                                f"{columns}")
    reference_column = cfg.reference_column
    if reference_column is not None and reference_column not in columns:
        raise SpecError(f"{KEY}.reference_column", f"column {reference_column!r} not found in {main.name}; columns: "
                                                   f"{columns}")
    if reference_column is None and "reference" in columns:
        reference_column = "reference"
    verifier = build_verifier(cfg.verifier, f"{KEY}.verifier")
    tools, names = [], set()
    for j, spec in enumerate(cfg.tools):
        tool = build_tool(spec.model_dump(exclude_unset=True), f"{KEY}.tools[{j}]", columns)
        if tool.name in names:
            raise SpecError(f"{KEY}.tools[{j}].name", f"two tools are named {tool.name!r}")
        names.add(tool.name)
        tools.append(tool)
    ts = TaskSet(cfg, columns, (main, np.arange(0)), (main, np.arange(0)), tools, verifier, prompt_mode,
                 reference_column)
    h = cfg.heldout
    if h.key_column is not None and h.key_column not in columns:
        raise SpecError(f"{KEY}.heldout.key_column", f"column {h.key_column!r} not found in {main.name}")
    # every row is checked before the split (a hashed split reads the prompts: keys come from the same pass)
    keys = _check_rows(ts, main, f"{KEY}.data", with_keys=h.kind == "fraction")
    ts.train, ts.heldout = _split_rows(cfg, main, keys)
    held_src = ts.heldout[0]
    if held_src is not main:
        missing = [c for c in [cfg.answer_column, *_needed_columns(ts)] if c not in held_src.table.column_names]
        if missing:
            raise SpecError(f"{KEY}.heldout", f"{held_src.name} lacks column(s) {missing} that {main.name} has")
        _check_rows(ts, held_src, f"{KEY}.heldout")
    for which, what in (("train", "training"), ("heldout", "held-out")):
        if ts.size(which) == 0:
            raise SpecError(f"{KEY}.heldout", f"the {what} split of {main.name} is empty ({_describe_split(cfg)}: "
                                              f"{ts.size('train')} training, {ts.size('heldout')} held-out rows)")
    for which in ("train", "heldout"):
        src, idx = ts.split(which)
        if reference_column and reference_column in src.table.column_names:
            col = _column(src.table, reference_column)
            ts.references[which] = sum(col[int(i)] is not None and not (isinstance(col[int(i)], (list, str))
                                                                      and not col[int(i)]) for i in idx)
        else:
            ts.references[which] = 0
    _verify_up_front(ts)
    return ts


def _needed_columns(ts: TaskSet) -> list[str]:
    kind, _, col = ts.prompt_mode.partition(":")
    cols = _template_fields(ts.cfg.prompt_template) if kind == "template" else [col]
    return cols + [c for t in ts.tools for c in t.bind.values()]


def _check_rows(ts: TaskSet, src: Source, key: str, with_keys: bool = False) -> list[str] | None:
    """Raise for the first unusable row; with ``with_keys``, each row's hashed-split key."""
    keys = [] if with_keys else None
    key_column = ts.cfg.heldout.key_column
    for i, row in _iter_rows(src.table):
        problem = ts.row_problem(row)
        if problem:
            raise SpecError(key, f"{src.label(i)}: {problem}")
        if with_keys:
            keys.append(json.dumps(row[key_column], sort_keys=True, default=str) if key_column else ts.identity(row))
    return keys


def _describe_split(cfg: DatasetConfig) -> str:
    h = cfg.heldout
    return {"column": lambda: f"heldout.column {h.column!r} in {h.values or ['test']}",
            "data": lambda: f"heldout.data {h.data}", "split": lambda: f"heldout.split {h.split!r}",
            "fraction": lambda: f"heldout.fraction {h.fraction}"}[h.kind]()


def _verify_up_front(ts: TaskSet) -> None:
    """Run the verifier on a few rows (their reference answer, else the ground truth as the answer): a check
    that raises fails now, naming the row, not mid-run."""
    src, idx = ts.train
    for k in range(min(VERIFY_UP_FRONT, len(idx))):
        i = int(idx[k])
        row = src.table[i]
        turns = ts.reference_turns(row)
        answer = parse_turn(turns[-1]).answer if turns else str(row[ts.cfg.answer_column])
        try:
            ts.verifier.verify(answer or "", row[ts.cfg.answer_column], row)
        except VerifierError as e:
            raise SpecError(f"{KEY}.verifier", f"{e} on {src.label(i)} (answer {answer!r})") from None


_CACHE: OrderedDict[str, TaskSet] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def load_taskset(kwargs: dict[str, Any]) -> TaskSet:
    """The validated ``TaskSet`` for these env kwargs, built once per process (and again if a local data file
    changes)."""
    cfg = parse_kwargs(kwargs)
    h = cfg.heldout
    tool_files = [t.function.rpartition(":")[0] for t in cfg.tools if t.function]
    files = [cfg.data, *([h.data] if h.data else []), *[f for f in tool_files if f.endswith(".py")]]
    key = json.dumps([cfg.model_dump(mode="json"), [_stamp(f) for f in files], os.getcwd()], sort_keys=True,
                     default=str)
    with _CACHE_LOCK:
        ts = _CACHE.get(key)
        if ts is None:
            ts = build_taskset(cfg)
            _CACHE[key] = ts
            while len(_CACHE) > 8:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
    return ts


# -- the env ------------------------------------------------------------------------------------------------------
class NoReference(LookupError):
    """The current row has no reference solution (so no oracle action)."""


class DatasetEnv(ToolEnv):
    """Tasks from rows of a dataset; see the module docstring for the options (all keyword arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        self.tasks = load_taskset(kwargs)
        cfg = self.tasks.cfg
        self._workdir = Workdir("marathon-dataset-tools-")
        self._row: dict[str, Any] = {}
        self.row_label, self.split = "", "train"
        tools = [t.make(lambda: self._row, self._workdir) for t in self.tasks.tools]
        super().__init__(tools, max_turns=cfg.max_turns, max_calls_per_turn=cfg.max_calls_per_turn,
                         max_observation_chars=cfg.max_observation_chars)
        self._seed: int | None = None
        self._infra: dict[str, Any] | None = None
        self._score: float | None = None

    # -- tasks ------------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._seed = seed
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "row": self.row_label, "split": self.split}

    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        ts = self.tasks
        options = options or {}
        if "index" in options:
            which = options.get("split", "train")
            if which not in ("train", "heldout"):
                raise ValueError(f"options['split'] must be 'train' or 'heldout', got {which!r}")
            k = int(options["index"])
            if not 0 <= k < ts.size(which):
                raise ValueError(f"options['index'] {k} out of range: the {which} split has {ts.size(which)} rows")
        elif self._seed is None:
            which, k = "train", int(self.np_random.integers(ts.size("train")))
        else:
            which, k = ts.locate(int(self._seed))
        self.split = which
        self._row, self.row_label = ts.row(which, k)
        self._infra, self._score = None, None
        self._workdir.close()  # a fresh sandbox directory per episode (untrusted tools)
        return ts.prompt(self._row)

    @property
    def row(self) -> dict[str, Any]:
        return self._row

    @property
    def uses_sandbox(self) -> bool:
        """Whether tool or verifier code runs in the code sandbox (``envs.sandbox.env_uses_sandbox``)."""
        return any(t.untrusted for t in self.tasks.tools) or self.tasks.verifier.ref is not None

    @property
    def ground_truth(self) -> Any:
        return self._row[self.tasks.cfg.answer_column]

    # -- scoring ----------------------------------------------------------------------------------------------
    def _is_correct(self, answer: str) -> bool:
        try:
            success, self._score = self.tasks.verifier.verify(answer, self.ground_truth, self._row)
        except VerifierError as e:  # an infrastructure failure of this episode, in envs.guard's format
            kind = "timeout" if e.kind == "verifier_timeout" else "exception"
            self._infra = {**failure_info(kind, "step", f"{self.row_label}: {e}", e.traceback), "source": "verifier"}
            return False
        return success

    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        if terminated or truncated:
            info["row"] = self.row_label
            if self._score is not None:
                info["score"] = self._score
            if self._infra is not None:
                info["infra_failure"] = dict(self._infra)
                obs = {"messages": [{"role": "tool", "content": f"error: {self._infra['message']}"}]}
        return obs, reward, terminated, truncated, info

    # -- reference solutions ---------------------------------------------------------------------------------------
    @property
    def oracle_action(self):
        """Replays the row's reference solution; absent (AttributeError) when the data has no references."""
        if not any(self.tasks.references.values()):
            raise AttributeError(self.no_oracle_reason)
        return self._oracle_action

    @property
    def no_oracle_reason(self) -> str | None:
        """Why SFT demos cannot be made from this data (None: they can)."""
        if any(self.tasks.references.values()):
            return None
        ts = self.tasks
        where = (f"its reference column {ts.reference_column!r} is empty" if ts.reference_column else
                 "no reference column")
        return (f"{ts.train[0].name} has no reference solutions ({where}): the SFT warm start needs them; add a "
                "'reference' column (a final answer, or a list of assistant turns) or name one with "
                "env.kwargs.reference_column, or set sft.steps: 0")

    def has_oracle(self, seed: int) -> bool:
        """Whether the row that ``seed`` names has a reference solution."""
        which, k = self.tasks.locate(seed)
        return self.tasks.reference_turns(self.tasks.row(which, k)[0]) is not None

    def _oracle_action(self) -> str:
        turns = self.tasks.reference_turns(self._row)
        if turns is None:
            raise NoReference(f"{self.row_label} has no reference solution")
        return turns[min(self._counters["turns"], len(turns) - 1)]

    # -- `marathon env check` -------------------------------------------------------------------------------------
    def check_dataset(self, max_rows: int = 200) -> tuple[list[str], list[str]]:
        """(problems, notes) for ``marathon env check``: tool schemas, the verifier on the reference answers
        (up to ``max_rows`` rows per split), the held-out split."""
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        ts = self.tasks
        problems, notes = [], []
        notes.append(f"data: {ts.size('train')} training rows ({ts.train[0].name}), {ts.size('heldout')} held-out rows "
                     f"({ts.heldout[0].name}; {_describe_split(ts.cfg)}); prompt from {ts.prompt_mode}")
        for t in ts.tools:
            try:
                Draft202012Validator.check_schema(t.parameters)
            except SchemaError as e:
                problems.append(f"tool {t.name!r}: invalid parameters schema: {e.message}")
            props = t.parameters.get("properties", {})
            untyped = [p for p, s in props.items() if not ({"type", "enum", "anyOf"} & set(s))]
            notes.append(f"tool {t.name}({', '.join(props)}){' [sandboxed]' if t.untrusted else ''}"
                         + (f", bound from the row: {t.bind}" if t.bind else "")
                         + (f"; parameters without a type: {untyped}" if untyped else ""))
        notes.append(f"verifier: {ts.verifier.name}; reference solutions: {ts.references['train']} training, "
                     f"{ts.references['heldout']} held-out rows")
        for which in ("train", "heldout"):
            src, idx = ts.split(which)
            picks = idx if len(idx) <= max_rows else idx[np.linspace(0, len(idx) - 1, max_rows).astype(int)]
            rejected, errors, checked = [], [], 0
            for i in picks:
                row = src.table[int(i)]
                turns = ts.reference_turns(row)
                if turns is None:
                    continue
                answer = parse_turn(turns[-1]).answer or ""
                checked += 1
                try:
                    ok, _ = ts.verifier.verify(answer, row[ts.cfg.answer_column], row)
                except VerifierError as e:
                    errors.append(f"{src.label(int(i))}: {e}")
                    continue
                if not ok:
                    rejected.append(f"{src.label(int(i))} (answer {answer!r}, truth {row[ts.cfg.answer_column]!r})")
            if errors:
                problems.append(f"verifier raised on {len(errors)} of {checked} {which} reference answers; first: "
                                f"{errors[0]}")
            if rejected:
                problems.append(f"verifier rejects {len(rejected)} of {checked} {which} reference answers; first: "
                                f"{rejected[0]}")
        tsrc, tidx = ts.train
        hsrc, hidx = ts.heldout
        seen = {}
        for i in tidx:
            seen.setdefault(ts.fingerprint(tsrc.table[int(i)]), int(i))
        leaks = [(int(i), seen[f]) for i in hidx if (f := ts.fingerprint(hsrc.table[int(i)])) in seen]
        if leaks:
            h, t = leaks[0]
            problems.append(f"held-out split leaks: {len(leaks)} held-out rows are training rows too (same prompt, "
                            f"tool data and ground truth; first: {hsrc.label(h)} = {tsrc.label(t)})")
        return problems, notes

    def close(self) -> None:
        self._workdir.close()
