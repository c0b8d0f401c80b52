"""Sandboxed code/file tasks: files in a fresh temporary directory, a ``run_python`` tool (``envs/sandbox.py``:
a kernel boundary of namespaces, seccomp and rlimits; time, memory and disk limits; no network) and a question
about the files.

Task kinds: ``sum`` (sum of numbers.txt), ``count`` (occurrences of a word in words.txt), ``sort`` (write
names.txt sorted to sorted.txt, then answer ``done``; graded on the file), ``csv_total`` (total of the value
column over data/part_*.csv). Presets: easy = sum/count over 10 items; medium = sum/count/sort over 100;
hard = all four over 1000 items (csv_total in 5 files). Override any field by keyword.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from envs.base import ToolEnv, resolve_config
from envs.haystack import FILLER
from envs.parsing import first_number, format_call
from envs.sandbox import SandboxLimits, run_python
from envs.tools import Tool, ToolTimeout, object_schema

KINDS = ("sum", "count", "sort", "csv_total")
SYSTEM = "Use the run_python tool (files are in its working directory), then reply: Final answer: <answer>"


@dataclass(frozen=True)
class CodeSandboxConfig:
    kinds: tuple[str, ...]  # task kinds to draw from
    n_items: int  # numbers / words / names / csv rows
    n_files: int = 5  # csv_total: files the rows are split over
    timeout_s: float = 5.0
    memory_mb: int = 256
    max_turns: int = 6


PRESETS = {
    "easy": CodeSandboxConfig(kinds=("sum", "count"), n_items=10),
    "medium": CodeSandboxConfig(kinds=("sum", "count", "sort"), n_items=100),
    "hard": CodeSandboxConfig(kinds=KINDS, n_items=1000, max_turns=8),
}
# code a perfect model runs for each kind
ORACLE_CODE = {
    "sum": "print(sum(int(line) for line in open('numbers.txt')))",
    "count": "print(open('words.txt').read().split().count({word!r}))",
    "sort": "names = open('names.txt').read().split()\nopen('sorted.txt', 'w').write('\\n'.join(sorted(names)) + '\\n')\nprint('written')",
    "csv_total": "import csv, glob\ntotal = 0\nfor path in sorted(glob.glob('data/*.csv')):\n"
    "    total += sum(int(row['value']) for row in csv.DictReader(open(path)))\nprint(total)",
}


class CodeSandboxEnv(ToolEnv):
    uses_sandbox = True  # a run refuses to start where the sandbox's kernel boundary cannot be built (envs/sandbox.py)

    def __init__(self, difficulty: Literal["easy", "medium", "hard"] = "easy", **overrides: Any) -> None:
        cfg = resolve_config(PRESETS, difficulty, overrides)
        if not cfg.kinds or set(cfg.kinds) - set(KINDS) or cfg.n_items < 1 or cfg.n_files < 1:
            raise ValueError(f"invalid code-sandbox config {cfg} (kinds among {KINDS})")
        self.config = cfg
        self.limits = SandboxLimits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
        tool = Tool(
            name="run_python",
            description=f"Run Python 3 code (stdlib only, no network, {cfg.timeout_s:g} s limit); returns its output.",
            parameters=object_schema({"code": {"type": "string"}}),
            fn=self._run_python,
            timeout_s=None,  # the sandbox enforces its own limit
        )
        super().__init__([tool], max_turns=cfg.max_turns)
        self.workdir: Path | None = None
        self._cleanup: weakref.finalize | None = None

    # -- task ---------------------------------------------------------------------------------------------
    def _fresh_workdir(self) -> Path:
        self.close()
        path = Path(tempfile.mkdtemp(prefix="marathon-code-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
        return path

    def _write(self, name: str, text: str) -> None:
        path = self.workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        cfg, rng = self.config, self.np_random
        self.workdir = self._fresh_workdir()
        self.kind = str(rng.choice(cfg.kinds))
        self._solved = False  # an answer task's value was printed by run_python
        n = cfg.n_items
        if self.kind == "sum":
            numbers = [int(x) for x in rng.integers(-1000, 1000, size=n)]
            self._write("numbers.txt", "".join(f"{x}\n" for x in numbers))
            self.expected, self.oracle_code = str(sum(numbers)), ORACLE_CODE["sum"]
            user = "What is the sum of the numbers in numbers.txt (one per line)?"
        elif self.kind == "count":
            vocab = [str(w) for w in rng.choice(FILLER, size=8, replace=False)]
            words = [str(w) for w in rng.choice(vocab, size=n)]
            word = words[int(rng.integers(n))]
            self._write("words.txt", "".join(" ".join(words[i:i + 10]) + "\n" for i in range(0, n, 10)))
            self.expected, self.oracle_code = str(words.count(word)), ORACLE_CODE["count"].format(word=word)
            user = f"How many times does the word '{word}' occur in words.txt?"
        elif self.kind == "sort":
            names = ["".join(str(c) for c in rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=6)) for _ in range(n)]
            self._write("names.txt", "".join(f"{x}\n" for x in names))
            self.expected, self.oracle_code = "\n".join(sorted(names)), ORACLE_CODE["sort"]
            user = "Write the names in names.txt sorted alphabetically, one per line, to sorted.txt; then answer done."
        else:
            values = [int(x) for x in rng.integers(0, 500, size=n)]
            for f in range(cfg.n_files):
                rows = "".join(f"{i},{values[i]}\n" for i in range(f, n, cfg.n_files))
                self._write(f"data/part_{f}.csv", "id,value\n" + rows)
            self.expected, self.oracle_code = str(sum(values)), ORACLE_CODE["csv_total"]
            user = "What is the total of the value column over all CSV files in data/?"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def _sorted_file_ok(self) -> bool:
        path = self.workdir / "sorted.txt"
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return False
        return [s.strip() for s in path.read_text(errors="replace").strip().splitlines()] == self.expected.split("\n")

    # -- tool, scoring, oracle ------------------------------------------------------------------------------
    def _run_python(self, code: str) -> str:
        r = run_python(code, self.workdir, self.limits)
        if r.timed_out:
            raise ToolTimeout(f"run_python timed out after {self.limits.timeout_s:g} s (process killed)"
                              + (f"; partial stdout:\n{r.stdout}" if r.stdout else ""))
        if self.kind != "sort" and r.returncode == 0 and r.stdout.strip() == self.expected:
            self._solved = True
        parts = [f"exit code: {r.returncode}"]
        parts += [f"stdout:\n{r.stdout}"] if r.stdout else []
        parts += [f"stderr:\n{r.stderr}"] if r.stderr else []
        return "\n".join(parts)

    def _is_correct(self, answer: str) -> bool:
        if self.kind == "sort":
            return self._sorted_file_ok()
        return first_number(answer) == float(self.expected)

    def oracle_action(self) -> str:
        done = self._sorted_file_ok() if self.kind == "sort" else self._solved
        if not done:
            return format_call("run_python", {"code": self.oracle_code})
        return f"Final answer: {'done' if self.kind == 'sort' else self.expected}"

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None
