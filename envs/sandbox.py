"""Run untrusted Python (a policy's tool code) behind a kernel boundary: ``run_python(code, cwd, limits)``.

The boundary is bubblewrap (``bwrap``, Debian package ``bubblewrap``); the threat model and the reason for each
choice are in envs/README.md, "Sandbox". Per call:

- **Namespaces**: new user, pid, mount, ipc, network, uts and cgroup namespaces. The child is pid 1 of its pid
  namespace (``--as-pid-1``: no unfiltered bwrap reaper beside it) and sees no other process; its network has
  only a loopback; it cannot make namespaces of its own (seccomp below, and ``--disable-userns``).
- **Identity**: uid/gid 1000 inside, no capabilities, ``no_new_privs``. When the trainer is root the sandbox
  runs as the host's ``nobody`` (65534), so even a kernel-level escape lands as an unprivileged user; where
  that cannot work (unprivileged user namespaces refused) bwrap runs as the trainer's user, the inside uid then
  mapping to it, still without capabilities. ``isolation()`` says which.
- **Files**: the root is a read-only tmpfs holding read-only binds of only what the interpreter needs (system
  libraries, the executable, its standard library without site-packages and tests), a fresh /proc, a read-only
  minimal /dev, and two size-capped tmpfs: /tmp and the working directory (same path as on the host). The
  episode directory itself is never mounted: its regular files are copied in with the code, and after the call
  the trainer takes back what the child left there, accepting only regular files and directories under it (no
  symlinks, devices, absolute or ``..`` paths), at most ``max_dir_mb`` in all. So nothing else of the host,
  the project or its output directory is visible, a disk-filling loop fills a capped tmpfs, and a call killed
  at its time limit leaves the episode directory as it was.
- **seccomp** (x86_64; the BPF is assembled here with ``struct``, no dependency): bwrap loads a filter that
  refuses (EPERM) process creation (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so threads
  fall back to clone), sockets of every family (``socketpair(AF_UNIX)`` excepted), ptrace and cross-process
  memory calls, mount and namespace calls, keyrings, bpf, perf events, io_uring, userfaultfd, memfd,
  handle-based opens, module/kexec/reboot/clock calls, TIOCSTI, and kills the process on a foreign syscall ABI
  (x32, i386). The bootstrap adds a second filter refusing execve/execveat before the user's code runs (bwrap
  itself must exec the interpreter).
- **Limits**: wall-clock ``timeout_s`` (then SIGKILL to the sandbox's pid 1, which takes its pid namespace
  with it, and to bwrap's process group; ``--die-with-parent`` covers a dying trainer), RLIMIT_CPU, RLIMIT_AS
  (``memory_mb``), RLIMIT_FSIZE (``max_file_mb``, stdout and stderr included), RLIMIT_NPROC (``max_procs``),
  RLIMIT_NOFILE (``max_open_files``), no core dumps. No environment variable of the trainer reaches the child.
- **Audit hook**, a second layer only (it lives in the child's interpreter, which the code can tamper with):
  it refuses sockets, processes, signals, ctypes, and file changes outside the working directory with a
  readable ``PermissionError: sandbox: ...`` for the policy.

``isolation()`` probes once per process what can be built here and returns what is in force; a run logs its
``summary``. Where no boundary can be built (no bwrap, user namespaces refused, not x86_64) ``run_python``
raises ``SandboxUnavailable`` unless the weaker mode was chosen explicitly (``env.sandbox: weak`` in a run
config, ``allow_weak()``, or ``MARATHON_SANDBOX=weak``): a plain subprocess with the same rlimits, its own
network namespace where ``unshare -n`` works, and the audit hook: not a security boundary against an adversary.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import marshal
import os
import platform
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

INSIDE_UID = INSIDE_GID = 1000  # the child's uid/gid inside its user namespace
NOBODY = 65534  # the host uid/gid the sandbox runs as when the trainer is root
RUNTIME_CACHE = Path("/var/cache/marathon-sandbox")  # root only: interpreter copies the host's nobody can read
WEAK_ENV = "MARATHON_SANDBOX"  # "weak": run without a kernel boundary (explicit opt-in)


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 256  # RLIMIT_AS
    max_file_mb: int = 8  # RLIMIT_FSIZE: each file written, stdout and stderr included
    max_output_chars: int = 4000  # of stdout / stderr returned
    max_dir_mb: int = 64  # the working directory (a tmpfs inside; also what is copied back)
    max_tmp_mb: int = 16  # /tmp (a tmpfs)
    max_procs: int = 32  # RLIMIT_NPROC: threads of the one process (new processes are refused anyway)
    max_open_files: int = 64  # RLIMIT_NOFILE


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when killed for the time limit
    timed_out: bool


class SandboxUnavailable(RuntimeError):
    """The kernel boundary cannot be built here and the weaker mode was not chosen explicitly."""


# -- seccomp ------------------------------------------------------------------------------------------------
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38
# x86_64 numbers (asm/unistd_64.h). Denied with EPERM by the first filter:
DENY_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304, "fanotify_init": 300,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "memfd_create": 319,
    "memfd_secret": 447, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170,
    "setdomainname": 171, "iopl": 172, "ioperm": 173, "quotactl": 179, "quotactl_fd": 443,
    "lookup_dcookie": 212, "vhangup": 153, "personality": 135, "uselib": 134, "nfsservctl": 180,
    "socket": 41,
}
NR = {"socketpair": 53, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone3": 435,
      "ioctl": 16}
AF_UNIX, TIOCSTI, TIOCLINUX = 1, 0x5412, 0x541C
CLONE_THREAD = 0x00010000
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080


def _assemble(program: list[tuple]) -> bytes:
    """Classic BPF from ``("ld", offset)``, ``("jeq"|"jge"|"jset", k, true_label, false_label)`` (None: next),
    ``("ret", value)`` and ``("label", name)``; jumps go forward only."""
    labels, pos = {}, 0
    for ins in program:
        if ins[0] == "label":
            labels[ins[1]] = pos
        else:
            pos += 1
    out, pos = [], 0
    for ins in program:
        op = ins[0]
        if op == "label":
            continue
        if op == "ld":  # BPF_LD | BPF_W | BPF_ABS
            out.append(struct.pack("<HBBI", 0x20, 0, 0, ins[1]))
        elif op == "ret":  # BPF_RET | BPF_K
            out.append(struct.pack("<HBBI", 0x06, 0, 0, ins[1]))
        else:  # BPF_JMP | {JEQ, JGE, JSET} | BPF_K
            code = {"jeq": 0x15, "jge": 0x35, "jset": 0x45}[op]
            jt, jf = (0 if t is None else labels[t] - pos - 1 for t in ins[2:4])
            assert 0 <= jt < 256 and 0 <= jf < 256, "seccomp program too long for a jump"
            out.append(struct.pack("<HBBI", code, jt, jf, ins[1]))
        pos += 1
    return b"".join(out)


def _arg_lo(i: int) -> int:  # offset of the low 32 bits of seccomp_data.args[i] (little endian)
    return 16 + 8 * i


def _preamble() -> list[tuple]:
    return [("ld", 4), ("jeq", AUDIT_ARCH_X86_64, None, "kill"), ("ld", 0), ("jge", X32_SYSCALL_BIT, "kill", None)]


def _tail() -> list[tuple]:
    return [("label", "allow"), ("ret", RET_ALLOW), ("label", "eperm"), ("ret", RET_ERRNO | EPERM),
            ("label", "enosys"), ("ret", RET_ERRNO | ENOSYS), ("label", "kill"), ("ret", RET_KILL_PROCESS)]


@functools.cache
def seccomp_filters() -> tuple[bytes, bytes] | None:
    """(the filter bwrap loads, the no-execve filter the bootstrap adds), or None off x86_64. bwrap's filter
    also stops process creation (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so threads
    fall back to clone); execve must wait for the second one, since bwrap itself execs the interpreter."""
    if platform.machine() != "x86_64":
        return None
    base = _preamble() + [("jeq", nr, "eperm", None) for nr in sorted(DENY_X86_64.values())]
    base += [("jeq", NR["fork"], "eperm", None), ("jeq", NR["vfork"], "eperm", None),
             ("jeq", NR["socketpair"], "socketpair", None), ("jeq", NR["clone"], "clone", None),
             ("jeq", NR["clone3"], "enosys", None), ("jeq", NR["ioctl"], "ioctl", None), ("ret", RET_ALLOW),
             ("label", "socketpair"), ("ld", _arg_lo(0)), ("jeq", AF_UNIX, "allow", "eperm"),
             ("label", "clone"), ("ld", _arg_lo(0)), ("jset", CLONE_NEW, "eperm", None),
             ("jset", CLONE_THREAD, "allow", "eperm"),
             ("label", "ioctl"), ("ld", _arg_lo(1)), ("jeq", TIOCSTI, "eperm", None),
             ("jeq", TIOCLINUX, "eperm", "allow")] + _tail()
    no_exec = _preamble() + [("jeq", NR["execve"], "eperm", None), ("jeq", NR["execveat"], "eperm", None),
                             ("ret", RET_ALLOW)] + _tail()
    return _assemble(base), _assemble(no_exec)


# The audit hook (a second layer; the policy reads its PermissionError): no sockets, processes, signals or
# ctypes; file changes only inside ROOT, reads only there and in the standard library.
HOOK = r"""
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
"""

# -- the child's side ---------------------------------------------------------------------------------------
# Runs as `python -I -S -B -c BOOTSTRAP` inside bwrap. Reads a header (code, limits, filter) and the working
# directory's files from stdin, sets the limits, loads the second seccomp filter, installs the audit hook, runs
# the code, then writes the working directory back on the descriptor the header names (in `finally`).
BOOTSTRAP = r"""
import marshal, os, resource, struct, sys
_h = sys.stdin.buffer
(_n,) = struct.unpack("<I", _h.read(4))
_H = marshal.loads(_h.read(_n))
for _fd in os.listdir("/proc/self/fd"):  # nothing the trainer or bwrap opened stays reachable
    if int(_fd) > 2 and int(_fd) != _H["out_fd"]:
        try:
            os.close(int(_fd))
        except OSError:
            pass
ROOT = _H["cwd"]
def _unpack(r):
    while True:
        t = r.read(1)
        if t in (b"E", b""):
            return
        (n,) = struct.unpack("<H", r.read(2))
        path = os.path.join(ROOT, r.read(n).decode("utf-8", "surrogateescape"))
        if t == b"D":
            os.makedirs(path, exist_ok=True)
            continue
        (size,) = struct.unpack("<Q", r.read(8))
        with open(path, "wb") as f:
            while size:
                chunk = r.read(min(size, 1 << 20))
                if not chunk:
                    raise EOFError("truncated file")
                f.write(chunk)
                size -= len(chunk)
_unpack(_h)
_null = os.open("/dev/null", os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
def _pack():
    import stat
    out = os.fdopen(_H["out_fd"], "wb", buffering=1 << 16)
    def rec(kind, rel):
        b = rel.encode("utf-8", "surrogateescape")
        out.write(kind + struct.pack("<H", len(b)) + b)
    for top, dirs, files in os.walk(ROOT):
        base = os.path.relpath(top, ROOT)
        for d in list(dirs):
            p = os.path.join(top, d)
            if os.path.islink(p):
                dirs.remove(d)
                continue
            rec(b"D", os.path.normpath(os.path.join(base, d)))
        for name in files:
            p = os.path.join(top, name)
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                data = f.read()
            rec(b"F", os.path.normpath(os.path.join(base, name)))
            out.write(struct.pack("<Q", len(data)) + data)
    out.write(b"E")
    out.close()
for _lim, _v in (("AS", _H["mem"]), ("FSIZE", _H["fsize"]), ("CORE", 0), ("NPROC", _H["nproc"]),
                 ("NOFILE", _H["nofile"]), ("MEMLOCK", 0), ("MSGQUEUE", 0)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + _lim), (_v, _v))
resource.setrlimit(resource.RLIMIT_CPU, (_H["cpu"], _H["cpu"] + 1))
if _H["seccomp"]:  # the second filter: no execve
    import ctypes
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    _f = _H["seccomp"]
    _buf = ctypes.create_string_buffer(_f, len(_f))
    _libc = ctypes.CDLL(None, use_errno=True)
    _prog = _Prog(len(_f) // 8, ctypes.addressof(_buf))
    if _libc.prctl(38, 1, 0, 0, 0) or _libc.prctl(22, 2, ctypes.byref(_prog), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        os.write(2, b"sandbox: cannot load the seccomp filter (errno %d)\n" % ctypes.get_errno())
        os._exit(125)
    del _libc, _buf, _Prog, _prog, ctypes
    sys.modules.pop("ctypes", None)
__HOOK__
if _H["hook"]:
    sys.addaudithook(hook)
_code, _status = _H.pop("code"), 0
try:
    exec(compile(_code, "<main>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    _status = 1
finally:
    try:
        _pack()
    except BaseException:
        pass
sys.exit(_status)
""".replace("__HOOK__", HOOK)

# The weaker mode (explicit opt-in only): a plain subprocess, limits and the audit hook, files in place.
WEAK_BOOTSTRAP = r"""
import os, resource, sys, traceback
mem, fsize, cpu = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
sys.stdin.close()
ROOT = os.path.realpath(os.getcwd())
__HOOK__
sys.addaudithook(hook)
try:
    exec(compile(code, "<main>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
""".replace("__HOOK__", HOOK)


# -- the working directory: copied in, copied back ----------------------------------------------------------
MAX_ENTRIES = 20000  # files and directories copied back, at most
MAX_PATH = 3000  # bytes of a path relative to the working directory


def _pack_dir(root: str, cap: int) -> bytes:
    """The regular files and directories under ``root`` as the bootstrap reads them (symlinks etc. skipped)."""
    out, total = [], 0

    def rec(kind: bytes, rel: str) -> None:
        b = os.fsencode(rel)
        out.append(kind + struct.pack("<H", len(b)) + b)

    for top, dirs, files in os.walk(root):
        base = os.path.relpath(top, root)
        for d in list(dirs):
            if os.path.islink(os.path.join(top, d)):
                dirs.remove(d)
            else:
                rec(b"D", os.path.normpath(os.path.join(base, d)))
        for name in files:
            path = os.path.join(top, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                data = f.read(cap - total + 1)
            total += len(data)
            if total > cap:
                raise OverflowError(f"the working directory holds more than {cap >> 20} MB (max_dir_mb)")
            rec(b"F", os.path.normpath(os.path.join(base, name)))
            out.append(struct.pack("<Q", len(data)) + data)
    out.append(b"E")
    return b"".join(out)


def _parse_tree(data: bytes, cap: int) -> list[tuple[bytes, bytes | None]] | None:
    """Validate what the sandbox sent back: [(relative path, file bytes or None for a directory)], or None if
    it is malformed, incomplete, over ``cap`` bytes or MAX_ENTRIES entries, or holds a path that is absolute,
    empty, too long, leaves the directory, comes twice or is both a file and a directory."""
    view, pos, total, entries, files, dirs = memoryview(data), 0, 0, [], set(), set()
    try:
        while True:
            kind = bytes(view[pos:pos + 1])
            pos += 1
            if kind == b"E":
                return entries if pos == len(data) and not files & dirs else None
            if kind not in (b"D", b"F") or len(entries) >= MAX_ENTRIES:
                return None
            (n,) = struct.unpack_from("<H", data, pos)
            rel = bytes(view[pos + 2:pos + 2 + n])
            pos += 2 + n
            parts = rel.split(b"/")
            if (len(rel) != n or not rel or len(rel) > MAX_PATH or b"\0" in rel or rel in files or rel in dirs
                    or any(p in (b"", b".", b"..") or len(p) > 255 for p in parts)):
                return None
            dirs.update(b"/".join(parts[:i]) for i in range(1, len(parts)))
            if kind == b"D":
                dirs.add(rel)
                entries.append((rel, None))
                continue
            files.add(rel)
            (size,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            total += size
            if total > cap or pos + size > len(data):
                return None
            entries.append((rel, bytes(view[pos:pos + size])))
            pos += size
    except struct.error:
        return None


def _apply_tree(root: str, entries: list[tuple[bytes, bytes | None]]) -> None:
    """Replace the contents of ``root`` by ``entries`` (already validated): directories and regular files,
    created fresh (O_EXCL | O_NOFOLLOW), so nothing is written through a link."""
    for child in os.scandir(root):
        if child.is_dir(follow_symlinks=False):
            shutil.rmtree(child.path)
        else:
            os.unlink(child.path)
    made = {b""}
    for rel, data in entries:
        parts = rel.split(b"/")
        for i in range(1, len(parts) + (data is None)):
            d = b"/".join(parts[:i])
            if d not in made:
                os.mkdir(os.path.join(os.fsencode(root), d), 0o755)
                made.add(d)
        if data is not None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(os.path.join(os.fsencode(root), rel), flags, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)


# -- what the interpreter needs -----------------------------------------------------------------------------
SKIP_STDLIB = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}


def _interpreter() -> dict[str, str]:
    """Host paths of the interpreter: executable, standard library, shared libpython (if any)."""
    paths = {"exe": os.path.realpath(sys.executable), "stdlib": os.path.realpath(sysconfig.get_paths()["stdlib"])}
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
        if os.path.isfile(lib):
            paths["libpython"] = lib  # the soname path the executable's RUNPATH names (bound at the same place)
    return paths


def _world_readable(path: str) -> bool:
    """Can any user reach ``path`` (o+x on every directory above it, o+r on it)?"""
    p = Path(path)
    try:
        return all(q.stat().st_mode & 0o001 for q in p.parents) and bool(p.stat().st_mode & 0o004)
    except OSError:
        return False


def _copy_runtime(interp: dict[str, str]) -> dict[str, str]:
    """A copy of the interpreter the host's nobody can read (when it lives under /root, say), made once per
    machine under RUNTIME_CACHE: executable, libpython, standard library without site-packages and tests."""
    st = os.stat(interp["exe"])
    key = hashlib.sha256(json.dumps([interp, st.st_size, st.st_mtime_ns]).encode()).hexdigest()[:16]
    dest = RUNTIME_CACHE / key
    out = {k: str(dest / k) for k in interp}
    if (dest / "complete").exists():
        return out
    RUNTIME_CACHE.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(RUNTIME_CACHE, 0o755)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=RUNTIME_CACHE))
    try:
        for k in ("exe", "libpython"):
            if k in interp:
                shutil.copy2(interp[k], tmp / k)
        shutil.copytree(interp["stdlib"], tmp / "stdlib", symlinks=True,
                        ignore=lambda d, names: [n for n in names if n in SKIP_STDLIB or n.startswith("config-")
                                                 or n.endswith((".opt-1.pyc", ".opt-2.pyc"))])
        (tmp / "complete").write_text("")
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "complete").exists():
            raise
    return out


def _system_mounts() -> list[str]:
    """bwrap arguments for the system libraries: /usr/lib*, /lib* as the host has them, the loader cache."""
    args = []
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    for d in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    if os.path.isdir("/usr/share/zoneinfo"):
        args += ["--ro-bind", "/usr/share/zoneinfo", "/usr/share/zoneinfo"]
    return args


# -- the boundary -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Boundary:
    """How bwrap is started: as the host's nobody (``drop``) or as the trainer's user, with these mounts."""

    bwrap: str
    drop: bool  # run as NOBODY (the trainer is root)
    mounts: tuple[str, ...]  # bwrap arguments binding the interpreter and system libraries
    interp: dict[str, str] = field(hash=False)  # the interpreter's paths inside (the host's)


@dataclass(frozen=True)
class Isolation:
    """What ``run_python`` enforces here; ``summary`` is the line a run logs."""

    kernel: bool  # a kernel boundary is in force (else: the weaker mode, or refusal)
    mechanism: str  # "bubblewrap 0.8.0" / "subprocess + audit hook"
    namespaces: tuple[str, ...] = ()
    host_uid: int | None = None  # the uid the sandbox runs as on the host
    inside_uid: int | None = None
    seccomp: str = "none"
    network: str = ""
    problem: str = ""  # why no kernel boundary (empty when kernel)
    weak_allowed: bool = False

    @property
    def summary(self) -> str:
        if self.kernel:
            who = "host uid %d (%s)" % (self.host_uid, "nobody" if self.host_uid == NOBODY else
                                         "root, no capabilities" if self.host_uid == 0 else "the trainer's user")
            return (f"code sandbox: kernel boundary ({self.mechanism}): {'/'.join(self.namespaces)} namespaces, "
                    f"{who}, uid {self.inside_uid} inside, no capabilities, seccomp {self.seccomp}, rlimits "
                    f"AS/CPU/FSIZE/NPROC/NOFILE, read-only interpreter, tmpfs /tmp and working directory "
                    f"(copied back), audit hook as a second layer")
        mode = ("WEAK mode (explicitly allowed)" if self.weak_allowed
                else "UNAVAILABLE (runs using code tools refuse to start)")
        return (f"code sandbox: {mode}: no kernel boundary ({self.problem}); {self.mechanism}, network: "
                f"{self.network}")


_lock = threading.Lock()
_weak_flag: bool | None = None


def allow_weak(allowed: bool = True) -> None:
    """Allow (or forbid again) the weaker mode in this process and the processes it starts (``MARATHON_SANDBOX``)."""
    global _weak_flag
    _weak_flag = allowed
    if allowed:
        os.environ[WEAK_ENV] = "weak"
    else:
        os.environ.pop(WEAK_ENV, None)


def weak_allowed() -> bool:
    return _weak_flag if _weak_flag is not None else os.environ.get(WEAK_ENV, "") == "weak"


PROBE = r"""
import json, os
st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    fork = "allowed"
except OSError as e:
    fork = e.errno
try:
    import socket
    socket.socket()
    sock = "allowed"
except OSError as e:
    sock = e.errno
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "cap": st["CapEff"].strip(), "fork": fork,
                  "socket": sock, "nnp": st.get("NoNewPrivs", "").strip(),
                  "filters": st.get("Seccomp_filters", "").strip(), "seccomp": st.get("Seccomp", "").strip()}))
"""


def _probe(b: Boundary) -> str:
    """Run the probe through ``b``; '' if the boundary holds as expected, else what is wrong."""
    with tempfile.TemporaryDirectory(prefix="marathon-sbx-probe-") as d:
        r = _run_bwrap(PROBE, d, SandboxLimits(timeout_s=20), b, hook=False)
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1][:300]
    try:
        got = json.loads(r.stdout)
    except ValueError:
        return f"unexpected probe output {r.stdout[:200]!r}"
    want_filters = seccomp_filters() is not None
    ok = (got["uid"] == INSIDE_UID and got["cap"].strip("0") == "" and got["nnp"] == "1"
          and (not want_filters or (got["fork"] == EPERM and got["socket"] == EPERM and got["seccomp"] == "2"
                                    and got["filters"] in ("", "2"))))  # "": a kernel that does not count them
    return "" if ok else f"the probe found {got}"


def _weak_isolation(problem: str) -> Isolation:
    net = "own network namespace (unshare -n)" if network_isolation() == "unshare" else "audit hook only"
    return Isolation(kernel=False, mechanism="subprocess + rlimits + audit hook", network=net, problem=problem,
                     weak_allowed=weak_allowed())


@functools.cache
def _boundary() -> tuple[Boundary | None, str]:
    """The boundary that works here (probed once per process) or None and why not."""
    bwrap = shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.path.exists(p)), None)
    if bwrap is None:
        return None, ("bubblewrap (bwrap) is not installed; scripts/bootstrap.sh installs the Debian package where "
                      "apt-get works")
    if seccomp_filters() is None:
        return None, f"no seccomp filter for {platform.machine()} (x86_64 only)"
    interp, problems = _interpreter(), []
    tries = []
    if os.geteuid() == 0:
        try:
            inside = interp if all(_world_readable(p) for p in interp.values()) else _copy_runtime(interp)
            tries.append(Boundary(bwrap, True, _mounts(interp, inside), interp))
        except OSError as e:
            problems.append(f"as nobody: cannot copy the interpreter to {RUNTIME_CACHE}: {e}")
    tries.append(Boundary(bwrap, False, _mounts(interp, interp), interp))
    for b in tries:
        why = _probe(b)
        if not why:
            return b, ""
        problems.append(f"{'as nobody' if b.drop else 'as ' + ('root' if os.geteuid() == 0 else 'this user')}: {why}")
    return None, "bwrap cannot build the sandbox here: " + "; ".join(problems)


def _mounts(interp: dict[str, str], source: dict[str, str]) -> tuple[str, ...]:
    """bwrap arguments: system libraries, then ``source``'s interpreter files at ``interp``'s paths."""
    args = _system_mounts()
    for k in ("exe", "libpython", "stdlib"):
        if k in interp and not any(interp[k].startswith(d + "/") for d in ("/usr/lib", "/usr/lib64")):
            args += ["--ro-bind", source[k], interp[k]]
    stdlib = interp["stdlib"]
    for sub in sorted(SKIP_STDLIB):  # hide site-packages and friends when the original is bound
        if os.path.isdir(os.path.join(stdlib, sub)) and source["stdlib"] == stdlib:
            args += ["--size", "4096", "--tmpfs", os.path.join(stdlib, sub), "--remount-ro", os.path.join(stdlib, sub)]
    return tuple(args)


def isolation() -> Isolation:
    """What ``run_python`` enforces in this process (probed once)."""
    with _lock:
        b, problem = _boundary()
    if b is None:
        return _weak_isolation(problem)
    return Isolation(kernel=True, mechanism=f"bubblewrap {_bwrap_version(b.bwrap)}",
                     namespaces=("user", "pid", "mount", "ipc", "net", "uts", "cgroup"),
                     host_uid=NOBODY if b.drop else os.geteuid(), inside_uid=INSIDE_UID,
                     seccomp=f"x86_64 ({len(DENY_X86_64)} calls denied, sockets, no fork/exec)",
                     network="own namespace, loopback only")


@functools.cache
def _bwrap_version(bwrap: str) -> str:
    try:
        return subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.split()[-1]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "?"


def require_kernel_boundary() -> Isolation:
    """``isolation()``, or ``SandboxUnavailable`` with one message when there is no boundary and the weaker
    mode was not chosen explicitly."""
    iso = isolation()
    if not iso.kernel and not weak_allowed():
        raise SandboxUnavailable(
            f"the code sandbox cannot build its kernel boundary here: {iso.problem}. Install bubblewrap (Debian: "
            f"apt-get install bubblewrap; scripts/bootstrap.sh does it where apt-get works), or opt into the weaker "
            f"mode (a subprocess and an audit hook, not a security boundary) with `env.sandbox: weak` in the run "
            f"config ({WEAK_ENV}=weak outside a run)")
    return iso


def env_uses_sandbox(env) -> bool:
    """Does this env run tool code in the sandbox? (``uses_sandbox`` on the env; for marathon/Dataset-v0: an
    untrusted tool or a sandboxed verifier.)"""
    u = getattr(env, "unwrapped", env)
    flag = getattr(u, "uses_sandbox", None)
    if flag is not None:
        return bool(flag() if callable(flag) else flag)
    tasks = getattr(u, "tasks", None)
    if tasks is not None:
        tools = getattr(tasks, "tools", ()) or ()
        verifier = getattr(tasks, "verifier", None)
        return any(getattr(t, "untrusted", False) for t in tools) or getattr(verifier, "ref", None) is not None
    return False


# -- running ------------------------------------------------------------------------------------------------
def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "\n... [output truncated]"


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def _pump(proc: subprocess.Popen, payload: bytes, reads: dict[int, bytearray], caps: dict[int, int],
          deadline: float) -> bool:
    """Write ``payload`` to the child's stdin and read the ``reads`` pipes (each up to its cap; the rest is
    drained and dropped) until they close or the deadline passes; True if every pipe finished in time."""
    view, sent, stdin = memoryview(payload), 0, proc.stdin.fileno()
    sel = selectors.DefaultSelector()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_WRITE)
    for fd in reads:
        sel.register(fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in sel.select(min(left, 1.0)):
                if key.fd == stdin:
                    try:
                        sent += os.write(key.fd, view[sent:sent + (1 << 16)])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the child stopped reading (it died, or closed stdin)
                        sent = len(view)
                    if sent >= len(view):
                        sel.unregister(key.fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                    elif len(reads[key.fd]) < caps[key.fd]:
                        reads[key.fd] += chunk
        return True
    finally:
        sel.close()


def _run_bwrap(code: str, cwd: str | Path, limits: SandboxLimits, b: Boundary, hook: bool = True) -> RunResult:
    cwd = os.path.realpath(cwd)
    cap = limits.max_dir_mb << 20
    try:
        tree = _pack_dir(cwd, cap)
    except OverflowError as e:
        return RunResult("", f"sandbox: {e}", 1, False)
    filters = seccomp_filters()
    out_r, out_w = os.pipe()  # the working directory, back
    info_r, info_w = os.pipe()  # bwrap's JSON about the child (its host pid)
    sec_r, sec_w = os.pipe()  # the seccomp program bwrap loads
    os.write(sec_w, filters[0])  # a few hundred bytes: fits the pipe buffer
    os.close(sec_w)
    header = marshal.dumps({"code": code, "cwd": cwd, "out_fd": out_w, "hook": hook,
                            "mem": limits.memory_mb << 20, "fsize": limits.max_file_mb << 20,
                            "cpu": int(limits.timeout_s) + 1, "nproc": limits.max_procs,
                            "nofile": limits.max_open_files, "seccomp": filters[1]})
    # --as-pid-1: no bwrap reaper inside (it would run without the seccomp filter, its memory open to the child)
    argv = [b.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_GID), "--hostname", "sandbox", "--cap-drop", "ALL",
            *b.mounts, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(limits.max_tmp_mb << 20), "--tmpfs", "/tmp",
            "--size", str(cap), "--tmpfs", cwd, "--remount-ro", "/", "--chdir", cwd,
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "HOME", cwd, "--setenv", "TMPDIR", cwd,
            "--seccomp", str(sec_r), "--info-fd", str(info_w),
            "--", b.interp["exe"], "-I", "-S", "-B", "-c", BOOTSTRAP]
    drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if b.drop else {}
    reads, caps = {out_r: bytearray(), info_r: bytearray()}, {out_r: cap + (1 << 20) + 1, info_r: 4096}
    with tempfile.TemporaryDirectory(prefix="marathon-sbx-out-") as out:
        out_path, err_path = Path(out, "stdout"), Path(out, "stderr")
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            try:
                proc = subprocess.Popen(argv, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                        stdin=subprocess.PIPE, stdout=fo, stderr=fe, start_new_session=True,
                                        pass_fds=(out_w, info_w, sec_r), **drop)
            finally:
                for fd in (out_w, info_w, sec_r):
                    os.close(fd)
            deadline = time.monotonic() + limits.timeout_s
            try:
                finished = _pump(proc, struct.pack("<I", len(header)) + header + tree, reads, caps, deadline)
                if finished:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(max(deadline - time.monotonic(), 0.01))
                timed_out = proc.poll() is None
            finally:
                if proc.poll() is None:
                    _stop(proc, reads[info_r])
                for fd in (out_r, info_r):
                    os.close(fd)
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        back = bytes(reads[out_r])
        entries = None if timed_out or len(back) > cap + (1 << 20) else _parse_tree(back, cap)
        if entries is not None and sorted(entries) != sorted(_parse_tree(tree, cap) or []):
            _apply_tree(cwd, entries)
        return RunResult(
            stdout=_read(out_path, limits.max_output_chars),
            stderr=_read(err_path, limits.max_output_chars),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
        )


def _stop(proc: subprocess.Popen, info: bytes) -> None:
    """SIGKILL the sandbox: its pid 1 first (the pid namespace dies with it and bwrap reaps it, so nothing is
    left, not even a zombie), then bwrap's whole process group."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        child = int(json.loads(info.decode(errors="replace").split("}")[0] + "}")["child-pid"])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
    _kill(proc)


def run_python(code: str, cwd: str | Path, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``code`` with ``cwd`` as working directory under ``limits``, behind the kernel boundary (or, where
    none can be built and the weaker mode was chosen explicitly, without it; else ``SandboxUnavailable``)."""
    with _lock:
        b, _ = _boundary()
    if b is not None:
        return _run_bwrap(code, cwd, limits, b)
    require_kernel_boundary()
    return _run_weak(code, cwd, limits)


# -- the weaker mode ----------------------------------------------------------------------------------------
@functools.cache
def network_isolation() -> str:
    """``"unshare"`` if a new network namespace can be made here (the weaker mode uses it), else ``"audit-hook"``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "audit-hook"
    try:
        ok = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "unshare" if ok else "audit-hook"


def isolation_prefix() -> list[str]:
    """The command prefix that gives the weaker mode's child its own network namespace (empty under "audit-hook")."""
    return [shutil.which("unshare") or "unshare", "-n", "--"] if network_isolation() == "unshare" else []


def _run_weak(code: str, cwd: str | Path, limits: SandboxLimits) -> RunResult:
    argv = [*isolation_prefix(), sys.executable, "-I", "-S", "-B", "-c", WEAK_BOOTSTRAP, str(limits.memory_mb << 20),
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
                _kill(proc)
            except BrokenPipeError:  # the child died before reading its code
                proc.wait()
        return RunResult(
            stdout=_read(out_path, limits.max_output_chars),
            stderr=_read(err_path, limits.max_output_chars),
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
        )
