"""Checkpoints that cannot vanish: a save interrupted at any point leaves a complete checkpoint to resume from.

Layout under a run's ``output_dir``::

    checkpoints/ckpt-000007/     complete checkpoints (normally one: the newest); each has MANIFEST.json
    checkpoints/.tmp-ckpt-000008 a save in progress (ignored and removed by the next start)
    checkpoints/.del-ckpt-000006 a replaced checkpoint being deleted (ignored and removed likewise)
    checkpoint -> checkpoints/ckpt-000007   convenience link to the newest (``marathon eval --checkpoint``)

``CheckpointStore.save(write)`` runs the sequence ``SAVE_POINTS`` names: a temporary directory, the contents
(``write(tmp)``: the driver's learner state, policy and ``driver.pt``), a manifest of every file and its size,
fsync of every file and directory, ONE rename to ``ckpt-<n>`` (the commit point), fsync of the parent, the
link, and only then the previous checkpoints are retired (renamed to ``.del-*``, then deleted). Until the
rename the previous checkpoint is untouched; after it the new one is complete. ``latest()`` picks the newest
``ckpt-*`` whose manifest matches its files, ignoring everything else; a run dir written by the previous
layout (a ``checkpoint/`` directory, or ``checkpoint.old/`` left by a save killed between its two renames)
is still found.

Fault injection (tests): ``MARATHON_CHECKPOINT_FAULT=<point>[@<n>]`` makes the process ``os._exit(FAULT_EXIT)``
at that point of its n-th save (default: every save); ``fault_point`` is also called by ``write`` between
the driver's parts (``learner``, ``policy``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

SAVE_POINTS = ("tmp", "learner", "policy", "written", "synced", "renamed", "linked", "retired", "deleted")
FAULT_ENV = "MARATHON_CHECKPOINT_FAULT"
FAULT_EXIT = 86
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_saves = 0  # saves started by this process (for FAULT_ENV's @n)


def fault_point(point: str) -> None:
    """Exit the process here if ``MARATHON_CHECKPOINT_FAULT`` names this point (and this save)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name == point and (not nth or int(nth) == _saves):
        os._exit(FAULT_EXIT)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root):
        for n in sorted(names):
            yield Path(dirpath) / n


class CheckpointStore:
    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self.root = self.out / "checkpoints"
        self.link = self.out / "checkpoint"

    # -- reading ----------------------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints, newest first (legacy layouts last)."""
        found = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                m = _NAME.match(d.name)
                if m and d.is_dir() and self.verify(d) is None:
                    found.append((int(m.group(1)), d))
        out = [d for _, d in sorted(found, reverse=True)]
        # the previous layout: checkpoint/ (a directory, not our link), or checkpoint.old/ alone after a kill
        for legacy in (self.link, self.out / "checkpoint.old"):
            if legacy.is_dir() and not legacy.is_symlink() and (legacy / "driver.pt").is_file():
                out.append(legacy)
        return out

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[0] if done else None

    @staticmethod
    def verify(d: Path) -> str | None:
        """Why ``d`` is not a complete checkpoint (None: it is): its manifest must list exactly its files, with
        their sizes."""
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            return f"no readable {MANIFEST} ({e})"
        have = {str(p.relative_to(d)): p.stat().st_size for p in _files(d) if p.name != MANIFEST}
        if have != manifest.get("files"):
            return f"{MANIFEST} does not match the files (missing, extra or truncated files)"
        return None

    # -- writing ----------------------------------------------------------------------------------------------
    def clean(self) -> None:
        """Remove saves that never completed and checkpoints being retired (one writer per run dir)."""
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.name.startswith((".tmp-", ".del-")):
                    shutil.rmtree(d, ignore_errors=True)

    def save(self, write: Callable[[Path], None]) -> Path:
        """Write a new checkpoint with ``write(tmp_dir)``; returns its final path (see the module doc)."""
        global _saves
        _saves += 1
        self.clean()
        self.root.mkdir(parents=True, exist_ok=True)
        numbers = [int(m.group(1)) for d in self.root.iterdir() if (m := _NAME.match(d.name))]
        name = f"ckpt-{max(numbers, default=0) + 1:06d}"
        tmp, final = self.root / f".tmp-{name}", self.root / name
        tmp.mkdir()
        fault_point("tmp")
        write(tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
        fault_point("written")
        for dirpath, _, names in os.walk(tmp):
            for n in names:
                _fsync(Path(dirpath) / n)
            _fsync(Path(dirpath))
        fault_point("synced")
        tmp.rename(final)  # the commit point
        _fsync(self.root)
        fault_point("renamed")
        self._point_link_at(final)
        fault_point("linked")
        for d in list(self.root.iterdir()):
            if _NAME.match(d.name) and d.name != name:
                d.rename(self.root / f".del-{d.name}")
        old = self.out / "checkpoint.old"  # the previous layout's leftover
        if old.is_dir() and not old.is_symlink():
            old.rename(self.root / ".del-legacy-old")
        fault_point("retired")
        self.clean()
        fault_point("deleted")
        return final

    def _point_link_at(self, final: Path) -> None:
        if self.link.is_dir() and not self.link.is_symlink():  # the previous layout's checkpoint/ directory
            self.link.rename(self.root / ".del-legacy")
        tmp_link = self.out / ".checkpoint.link"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        tmp_link.symlink_to(final.relative_to(self.out))
        os.replace(tmp_link, self.link)
        _fsync(self.out)
