"""Run untrusted Python in a subprocess with a time limit, resource limits and no network.

- Time: wall-clock ``timeout_s``; on expiry the whole process group is killed (SIGKILL). Also RLIMIT_CPU.
- Memory: RLIMIT_AS = ``memory_mb`` (allocations beyond raise MemoryError in the child).
- Network: when ``unshare -n`` works here (root or user namespaces), the child runs in a new, empty network
  namespace (only a down loopback). In every case an audit hook installed before the code runs refuses
  sockets, new processes (fork, exec, subprocess, os.system), signals to other processes and ctypes, so the
  code cannot step around the hook through a helper program. ``network_isolation()`` says which applies.
- Files: the child runs in the given working directory (also its HOME and TMPDIR). The audit hook allows
  writes, renames, deletions, chmod etc. only inside it (paths resolved through symlinks, ``dir_fd`` and
  file descriptors), and reads only inside it and the standard library. RLIMIT_FSIZE caps every file
  written, including stdout/stderr, which go to files outside the working directory and are read back up
  to ``max_output_chars``.
- Interpreter: ``python -I -S -B`` (isolated mode, no site-packages): the standard library only.
The audit hook is a guard against an RL policy's accidents, not a security boundary against an adversary
(run training as an unprivileged user); the network namespace is a real kernel boundary.
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
import os, resource, sys, traceback
mem, fsize, cpu = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
sys.stdin.close()
ROOT = os.path.realpath(os.getcwd())
READ_ROOTS = (ROOT, os.path.realpath(os.path.dirname(os.__file__)), "/dev/null", "/dev/urandom")
BLOCKED = ("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
           "pty.", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill")
# event -> (index of a path argument, index of its dir_fd argument or None), for calls that change files
MUTATE = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),),
          "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.symlink": ((1, 2),), "os.link": ((0, 2), (1, 3)),
          "os.utime": ((0, 3),), "os.truncate": ((0, None),), "shutil.rmtree": ((0, 1),), "os.chdir": ((0, None),)}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def where(path, dir_fd=None):  # the real path a call acts on (descriptors resolved through /proc/self/fd)
    if isinstance(path, int):
        return os.readlink(f"/proc/self/fd/{path}")
    path = os.fsdecode(path)
    if dir_fd not in (None, -1) and not os.path.isabs(path):  # -1: no dir_fd given
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)
def inside(path, roots):
    return any(path == r or path.startswith(r + os.sep) for r in roots)
def deny(why):
    raise PermissionError(f"sandbox: {why}")
def hook(event, args):
    if event.startswith(BLOCKED):
        deny(f"{event} is not allowed (no network, no new processes)")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        write = any(c in (mode or "") for c in "wax+") or (flags or 0) & WRITE
        if not inside(where(path), (ROOT,) if write else READ_ROOTS):
            deny(f"{'writing' if write else 'reading'} {os.fsdecode(path)!r} is not allowed (only the working directory)")
    elif event in ("os.listdir", "os.scandir") and isinstance(args[0], (str, bytes)):
        if not inside(where(args[0]), READ_ROOTS):
            deny(f"listing {os.fsdecode(args[0])!r} is not allowed (only the working directory)")
    elif event in MUTATE:
        for p, d in MUTATE[event]:
            if not inside(where(args[p], None if d is None else args[d]), (ROOT,)):
                deny(f"{event} outside the working directory is not allowed")
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


def isolation_prefix() -> list[str]:
    """The command prefix that gives the child its own network namespace (empty under "audit-hook")."""
    return [shutil.which("unshare") or "unshare", "-n", "--"] if network_isolation() == "unshare" else []


def run_python(code: str, cwd: str | Path, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``code`` with ``cwd`` as working directory under ``limits``."""
    argv = [*isolation_prefix(), sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, str(limits.memory_mb << 20),
            str(limits.max_file_mb << 20), str(int(limits.timeout_s) + 1)]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(cwd), "TMPDIR": str(cwd)}
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
