"""Run untrusted Python in a subprocess with a time limit, resource limits and no network.

- Time: wall-clock ``timeout_s``; on expiry the whole process group is killed (SIGKILL). Also RLIMIT_CPU.
- Memory: RLIMIT_AS = ``memory_mb`` (allocations beyond raise MemoryError in the child).
- Files: the child runs in the given working directory; RLIMIT_FSIZE caps every file it writes, and its
  stdout/stderr (which go to files outside the working directory, read back up to ``max_output_chars``).
- Network: when ``unshare -n`` works here (root or user namespaces), the child runs in a new, empty network
  namespace (no interfaces but a down loopback). In every case an audit hook installed before the code runs
  refuses socket creation/connection, new processes (fork, exec, subprocess, os.system) and ctypes, so the
  code cannot step around the hook through a helper program. ``network_isolation()`` says which applies.
- Interpreter: ``python -I -S -B`` (isolated mode, no site-packages): the standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs in the child before the user's code (read from stdin): limits, audit hook, then exec.
BOOTSTRAP = r"""
import resource, sys, traceback
mem, fsize, cpu = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
sys.stdin.close()
BLOCKED = ("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
           "pty.", "ctypes.")
def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed (no network, no new processes)")
sys.addaudithook(hook)
try:
    exec(compile(code, "<main>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 256
    max_file_mb: int = 8
    max_output_chars: int = 4000


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when killed for the time limit
    timed_out: bool


@functools.cache
def network_isolation() -> str:
    """``"unshare"`` if a new network namespace can be made here, else ``"audit-hook"``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "audit-hook"
    try:
        ok = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "unshare" if ok else "audit-hook"


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "\n... [output truncated]"


def run_python(code: str, cwd: str | Path, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``code`` with ``cwd`` as working directory under ``limits``."""
    argv = [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, str(limits.memory_mb << 20),
            str(limits.max_file_mb << 20), str(int(limits.timeout_s) + 1)]
    if network_isolation() == "unshare":
        argv = [shutil.which("unshare") or "unshare", "-n", "--", *argv]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(cwd)}
    with tempfile.TemporaryDirectory(prefix="marathon-sbx-out-") as out:
        out_path, err_path = Path(out, "stdout"), Path(out, "stderr")
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=fo, stderr=fe,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.communicate(code.encode("utf-8", errors="replace"), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except BrokenPipeError:  # the child died before reading its code
                proc.wait()
        return RunResult(
            stdout=_read(out_path, limits.max_output_chars),
            stderr=_read(err_path, limits.max_output_chars),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
        )
