"""Red team for the code sandbox (envs/sandbox.py): escape attempts an RL policy could make, each of which must
fail with the host unchanged.

Every attempt first tampers with the audit hook (the second layer, which lives in the attacked interpreter) so
that what is tested is the kernel boundary; one test shows the tampering works. Each attack prints
``BLOCKED <name> ...`` or ``ESCAPED <name> ...`` per attempt; a test asserts the expected BLOCKED lines, no
ESCAPED line, and (``Host.check``) that nothing outside the episode directory changed: files under the test's
directory (a fake checkpoint and secret among them), the interpreter copy, the repository, marker paths in the
host's /tmp and /root, the trainer's environment, and that no process of the sandbox's pid namespace is left.

The suite needs the kernel boundary (CI installs bubblewrap through scripts/bootstrap.sh) and fails without it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from envs import sandbox
from envs.sandbox import NOBODY, RUNTIME_CACHE, SandboxLimits, isolation, run_python

REPO = Path(__file__).resolve().parents[1]

# Runs before every attack: report the pid namespace (to look for survivors), neuter the audit hook (so the
# kernel boundary alone is tested), and define attempt(): one BLOCKED/ESCAPED line per attempt.
PRELUDE = r'''
import os, sys
print("PIDNS", os.readlink("/proc/self/ns/pid"), flush=True)
_g = sys.modules["__main__"].__dict__
_g["BLOCKED"], _g["MUTATE"], _g["inside"] = ("\0",), {}, (lambda *a: True)
def attempt(name, fn, *args, **kw):
    try:
        out = fn(*args, **kw)
    except BaseException as e:
        print("BLOCKED", name, type(e).__name__, getattr(e, "errno", ""), flush=True)
        return None
    print("ESCAPED", name, repr(out)[:200], flush=True)
    return out
def libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)
def system(cmd):  # os.system returns a status: a shell that cannot start is a failure, not an exception
    rc = os.system(cmd)
    if rc:
        raise OSError(f"no shell (status {rc})")
    return rc
def raw(name, nr, *args):  # a raw syscall through ctypes: "ESCAPED" only if it does not fail
    ctypes, c = libc()
    def go():
        r = c.syscall(nr, *args)
        if r < 0:
            raise OSError(ctypes.get_errno(), f"syscall {nr}")
        return r
    return attempt(name, go)
'''


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Host:
    """A host with something to lose, and a check that it lost nothing."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.token = root, uuid.uuid4().hex[:12]
        self.episode = root / "episode"
        self.episode.mkdir()
        (self.episode / "numbers.txt").write_text("1\n2\n3\n")
        self.outside = root / "host"
        (self.outside / "runs" / "ckpt").mkdir(parents=True)
        (self.outside / "runs" / "ckpt" / "model.safetensors").write_bytes(os.urandom(4096))
        (self.outside / "runs" / "metrics.csv").write_text("step,reward\n0,0.1\n")
        self.secret = self.outside / "secret.txt"
        self.secret.write_text(f"TOPSECRET-{self.token}")
        self.secret.chmod(0o600)
        monkeypatch.setenv("MARATHON_REDTEAM_SECRET", f"ENVSECRET-{self.token}")
        self.markers = [Path(p) / f"pwned-{self.token}" for p in ("/tmp", "/root", "/var/tmp", str(REPO), "/")]
        self.before = self.state()

    def state(self) -> dict:
        files = {}
        for p in sorted(self.root.rglob("*")):
            if p == self.episode or self.episode in p.parents:
                continue
            st = p.lstat()
            files[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, _digest(p) if stat.S_ISREG(st.st_mode) else "")
        cache = {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in RUNTIME_CACHE.rglob("*")} \
            if RUNTIME_CACHE.is_dir() else {}
        return {"files": files, "runtime": hashlib.sha256(repr(sorted(cache.items())).encode()).hexdigest(),
                "markers": [m.exists() for m in self.markers], "repo_pwned": glob.glob(str(REPO / "**/pwned*"),
                                                                                       recursive=True),
                "env": os.environ.get("MARATHON_REDTEAM_SECRET")}

    def episode_ok(self, max_mb: int) -> None:
        """The episode directory holds only regular files and directories, within the size cap."""
        total = 0
        for p in self.episode.rglob("*"):
            st = p.lstat()
            assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), f"{p} is neither a file nor a directory"
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        assert total <= max_mb << 20

    def check(self, r: sandbox.RunResult, limits: SandboxLimits = SandboxLimits()) -> None:
        assert self.state() == self.before, "the host changed"
        self.episode_ok(limits.max_dir_mb)
        ns = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("PIDNS ")]
        assert ns, f"the attack did not start: {r}"
        left = []
        for p in glob.glob("/proc/[0-9]*/ns/pid"):
            try:
                if os.readlink(p) == ns[0]:
                    left.append(p.split("/")[2])
            except OSError:
                pass
        assert not left, f"processes of the sandbox survived: {left}"


@pytest.fixture(scope="module", autouse=True)
def boundary():
    iso = isolation()
    assert iso.kernel, f"the red-team suite needs the sandbox's kernel boundary: {iso.problem}"
    return iso


@pytest.fixture
def host(tmp_path, monkeypatch):
    return Host(tmp_path, monkeypatch)


def attack(host: Host, code: str, limits: SandboxLimits = SandboxLimits(timeout_s=20)) -> sandbox.RunResult:
    r = run_python(PRELUDE + code, host.episode, limits)
    host.check(r, limits)
    assert "ESCAPED" not in r.stdout, r.stdout
    return r


def blocked(r: sandbox.RunResult, *names: str) -> None:
    got = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("BLOCKED ")}
    missing = set(names) - got
    assert not missing, f"attempts that did not run or did not fail: {missing}\n{r.stdout}\n{r.stderr}"


# -- tampering with the guard ---------------------------------------------------------------------------------
def test_the_audit_hook_can_be_neutered_but_the_kernel_still_refuses(host):
    r = attack(host, rf'''
open("/tmp/pwned-{host.token}", "w").write("x")  # outside the working directory: the hook would refuse this
print("HOOK-OFF", flush=True)
attempt("fork", os.fork)
attempt("system", system, "id > /tmp/x")
attempt("connect", __import__("socket").create_connection, ("127.0.0.1", 22))
''')
    assert "HOOK-OFF" in r.stdout  # the hook no longer refuses anything; the kernel does
    blocked(r, "fork", "system", "connect")


def test_no_way_back_to_privilege_or_to_an_unfiltered_state(host):
    r = attack(host, r'''
import ctypes
raw("seccomp-off", 157, 22, 0, 0, 0, 0)            # prctl(PR_SET_SECCOMP, SECCOMP_MODE_DISABLED)
raw("setuid0", 105, 0)                             # setuid(0)
raw("unshare-user", 272, 0x10000000)               # unshare(CLONE_NEWUSER)
raw("unshare-mount", 272, 0x00020000)              # unshare(CLONE_NEWNS)
raw("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
raw("chroot", 161, b"/tmp")
raw("setns", 308, os.open("/proc/self/ns/net", os.O_RDONLY), 0)
raw("bpf", 321, 0, 0, 0)
raw("keyctl", 250, 0, 0, 0)
raw("ptrace-self-parent", 101, 16, 1, 0, 0)        # PTRACE_ATTACH to pid 1
raw("memfd", 319, b"x", 0)
raw("io_uring", 425, 8, 0)
raw("userfaultfd", 323, 0)
raw("perf", 298, 0, 0, -1, -1, 0)
attempt("cap-raise", lambda: open("/proc/self/status").read().split("CapEff:")[1].split()[0].strip("0") or
        (_ for _ in ()).throw(PermissionError("no capabilities")))
''')
    blocked(r, "seccomp-off", "setuid0", "unshare-user", "unshare-mount", "mount", "chroot", "setns", "bpf", "keyctl",
            "ptrace-self-parent", "memfd", "io_uring", "userfaultfd", "perf", "cap-raise")


def test_a_forged_copy_back_stream_is_rejected(host):
    r = attack(host, r'''
import struct
fd = sys.modules["__main__"].__dict__["_H"]["out_fd"]
def rec(kind, path, data=None):
    b = path.encode()
    out = kind + struct.pack("<H", len(b)) + b
    return out + (struct.pack("<Q", len(data)) + data if data is not None else b"")
forged = rec(b"F", "../../pwned-" + "x", b"1") + rec(b"F", "/etc/pwned", b"1") + rec(b"S", "link", b"/") + b"E"
os.write(fd, forged)
open("numbers.txt", "w").write("changed")
print("FORGED", flush=True)
''')
    assert "FORGED" in r.stdout
    assert (host.episode / "numbers.txt").read_text() == "1\n2\n3\n"  # the whole stream was refused
    assert not (host.root / "pwned-x").exists() and not Path("/etc/pwned").exists()


def _rec(kind: bytes, path: str, data: bytes | None = None) -> bytes:
    import struct

    b = path.encode()
    return kind + struct.pack("<H", len(b)) + b + (b"" if data is None else struct.pack("<Q", len(data)) + data)


@pytest.mark.parametrize("stream", [
    _rec(b"F", "../x", b"1") + b"E", _rec(b"F", "/etc/x", b"1") + b"E", _rec(b"F", "a//b", b"1") + b"E",
    _rec(b"F", "a/./b", b"1") + b"E", _rec(b"F", "a", b"1") + _rec(b"F", "a", b"2") + b"E",
    _rec(b"F", "a", b"1") + _rec(b"F", "a/b", b"2") + b"E", _rec(b"D", "a") + _rec(b"F", "a", b"1") + b"E",
    _rec(b"S", "link", b"/") + b"E", _rec(b"F", "x", b"1"), _rec(b"F", "x", b"1") + b"EE",
    _rec(b"F", "x", b"1" * ((1 << 20) + 1)) + b"E", _rec(b"F", "x" * 3001, b"") + b"E", b"",
], ids=["dotdot", "absolute", "empty-part", "dot", "twice", "file-and-dir", "dir-and-file", "symlink",
        "unterminated", "trailing", "over-cap", "long-path", "nothing"])
def test_the_copy_back_refuses_malformed_streams(stream):
    assert sandbox._parse_tree(stream, 1 << 20) is None
    assert sandbox._parse_tree(_rec(b"D", "a") + _rec(b"F", "a/x", b"1") + b"E", 1 << 20) == [(b"a", None),
                                                                                           (b"a/x", b"1")]


# -- process creation, every route ----------------------------------------------------------------------------
def test_process_creation_through_the_os_module_fails(host):
    r = attack(host, r'''
import pty, subprocess
attempt("fork", os.fork)
attempt("forkpty", os.forkpty)
attempt("pty.fork", pty.fork)
attempt("posix_spawn", os.posix_spawn, sys.executable, [sys.executable, "-c", "pass"], {})
attempt("posix_spawnp", os.posix_spawnp, "sh", ["sh", "-c", "true"], {})
attempt("spawnv", os.spawnv, os.P_WAIT, sys.executable, [sys.executable, "-c", "pass"])
attempt("execv", os.execv, sys.executable, [sys.executable, "-c", "print('ESCAPED execv')"])
attempt("execve-sh", os.execve, "/bin/sh", ["sh", "-c", "echo ESCAPED"], {})
attempt("subprocess", subprocess.run, ["/bin/sh", "-c", "echo hi"])
attempt("subprocess-python", subprocess.run, [sys.executable, "-c", "print(1)"])
attempt("popen", lambda: os.popen("echo hi").read() or (_ for _ in ()).throw(OSError("no output")))
attempt("system", system, "echo hi")
''')
    blocked(r, "fork", "forkpty", "pty.fork", "posix_spawn", "posix_spawnp", "spawnv", "execv", "execve-sh",
            "subprocess", "subprocess-python", "popen", "system")


def test_process_creation_at_the_c_level_fails(host):
    r = attack(host, r'''
import _posixsubprocess
r_, w_ = os.pipe()
attempt("fork_exec", _posixsubprocess.fork_exec, [sys.executable.encode()], [sys.executable.encode()], True, (),
        None, None, -1, -1, -1, -1, -1, -1, r_, w_, False, False, False, None, None, None, -1, None, False)
ctypes, c = libc()
def call(fn, *a):
    res = fn(*a)
    if res < 0:
        raise OSError(ctypes.get_errno(), "failed")
    return res
attempt("libc-fork", call, c.fork)
attempt("libc-execv", call, c.execv, sys.executable.encode(), None)
raw("clone", 56, 17, 0, 0, 0, 0)                    # clone(SIGCHLD): a new process
raw("clone-newpid", 56, 0x20000000 | 17, 0, 0, 0, 0)
raw("clone3", 435, 0, 0)
raw("vfork", 58)
raw("execveat", 322, -100, sys.executable.encode(), 0, 0, 0)
import multiprocessing
attempt("multiprocessing", lambda: multiprocessing.get_context("fork").Process(target=print).start())
''')
    blocked(r, "fork_exec", "libc-fork", "libc-execv", "clone", "clone-newpid", "clone3", "vfork", "execveat",
            "multiprocessing")


# -- files: outside the directory, symlinks, /proc, descriptors ----------------------------------------------
def test_absolute_paths_outside_are_unreachable(host):
    secret, ckpt = host.secret, host.outside / "runs" / "ckpt" / "model.safetensors"
    r = attack(host, rf'''
attempt("read-secret", lambda: open({str(secret)!r}).read())
attempt("read-ckpt", lambda: open({str(ckpt)!r}, "rb").read())
attempt("write-ckpt", lambda: open({str(ckpt)!r}, "wb").write(b"0"))
attempt("write-metrics", lambda: open({str(host.outside / "runs" / "metrics.csv")!r}, "a").write("9,9\n"))
attempt("read-repo", lambda: open({str(REPO / "envs" / "sandbox.py")!r}).read())
attempt("write-repo", lambda: open({str(REPO / ("pwned-" + host.token))!r}, "w").write("x"))
attempt("read-passwd", lambda: open("/etc/passwd").read())
attempt("read-shadow", lambda: open("/etc/shadow").read())
attempt("list-root-home", lambda: os.listdir("/root/.ssh"))
attempt("write-root", lambda: open("/root/pwned-{host.token}", "w").write("x"))
attempt("write-slash", lambda: open("/pwned-{host.token}", "w").write("x"))
attempt("write-usr", lambda: open("/usr/lib/pwned-{host.token}", "w").write("x"))
attempt("write-stdlib", lambda: open(os.path.join(os.path.dirname(os.__file__), "os.py"), "a").write("#"))
attempt("write-runtime-cache", lambda: open({str(RUNTIME_CACHE / "pwned")!r}, "w").write("x"))
attempt("read-sys", lambda: os.listdir("/sys/class/net"))
attempt("dotdot", lambda: open("../host/secret.txt").read())
attempt("dotdot-deep", lambda: open("../../../../../../etc/passwd").read())
open("/tmp/pwned-{host.token}", "w").write("lands in the sandbox's own /tmp")
''')
    blocked(r, "read-secret", "read-ckpt", "write-ckpt", "write-metrics", "read-repo", "write-repo", "read-passwd",
            "read-shadow", "list-root-home", "write-root", "write-slash", "write-usr", "write-stdlib",
            "write-runtime-cache", "read-sys", "dotdot", "dotdot-deep")


def test_symlinks_and_hard_links_do_not_lead_out(host):
    r = attack(host, rf'''
os.symlink({str(host.secret)!r}, "to-secret")
os.symlink("/", "to-root")
os.symlink("/etc/shadow", "sorted.txt")   # the env reads sorted.txt on the host after the call
attempt("read-via-link", lambda: open("to-secret").read())
attempt("write-via-link", lambda: open("to-secret", "w").write("x"))
attempt("walk-via-dir-link", lambda: os.listdir("to-root/root/.ssh"))
attempt("hardlink-secret", os.link, {str(host.secret)!r}, "hard")
attempt("hardlink-stdout", os.link, "/proc/self/fd/1", "hard-out", follow_symlinks=True)
attempt("rename-out", os.rename, "numbers.txt", {str(host.outside / "moved.txt")!r})
open("suid", "w").write("#!/bin/sh")
os.chmod("suid", 0o6777)
''')
    blocked(r, "read-via-link", "write-via-link", "walk-via-dir-link", "hardlink-secret", "hardlink-stdout",
            "rename-out")
    names = sorted(p.name for p in host.episode.iterdir())
    assert names == ["numbers.txt", "suid"], names  # links never come back to the host
    assert stat.S_IMODE((host.episode / "suid").stat().st_mode) == 0o644  # nor modes


def test_proc_shows_only_the_sandbox(host):
    r = attack(host, rf'''
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("PIDS", pids, flush=True)
attempt("host-pids", lambda: pids if pids != [1] else (_ for _ in ()).throw(LookupError("only itself")))
attempt("trainer-environ", lambda: open("/proc/{os.getpid()}/environ").read())
attempt("trainer-root", lambda: os.listdir("/proc/{os.getpid()}/root"))
attempt("init-root-escape", lambda: open("/proc/1/root/../../etc/shadow").read())
attempt("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("b"))
attempt("sysctl", lambda: open("/proc/sys/kernel/hostname", "w").write("pwned"))
attempt("kcore", lambda: open("/proc/kcore", "rb").read(16))
attempt("core-pattern", lambda: open("/proc/sys/kernel/core_pattern", "w").write("|/bin/sh"))
attempt("mountinfo-leak", lambda: [l for l in open("/proc/self/mountinfo") if {str(host.outside)!r} in l
                                   or "/runs" in l] or (_ for _ in ()).throw(LookupError("no host dir mounted")))
''')
    assert "PIDS [1]" in r.stdout
    blocked(r, "host-pids", "trainer-environ", "trainer-root", "init-root-escape", "sysrq", "sysctl", "kcore",
            "core-pattern", "mountinfo-leak")


def test_inherited_descriptors_lead_nowhere(host):
    r = attack(host, r'''
import stat
def is_open(fd):
    try:
        return os.fstat(fd) is not None
    except OSError:
        return False
out_fd = sys.modules["__main__"].__dict__["_H"]["out_fd"]
print("FDS", [fd for fd in range(4096) if is_open(fd)], out_fd, flush=True)
def dirs():
    found = [fd for fd in range(4096) if is_open(fd) and stat.S_ISDIR(os.fstat(fd).st_mode)]
    if not found:
        raise LookupError("no directory descriptor")
    return found
attempt("dir-descriptor", dirs)
attempt("stdout-parent", lambda: os.listdir("/proc/self/fd/1/.."))
attempt("openat-stdout-dotdot", lambda: os.open("..", os.O_RDONLY, dir_fd=1))
attempt("fchdir-stdout", os.fchdir, 1)
attempt("pipe-parent", lambda: os.listdir(f"/proc/self/fd/{out_fd}/.."))
''')
    fds, out_fd = next(line for line in r.stdout.splitlines() if line.startswith("FDS "))[4:].rsplit(" ", 1)
    assert fds == f"[0, 1, 2, {out_fd}]"  # stdin (/dev/null), stdout, stderr, the copy-back pipe: nothing else
    blocked(r, "dir-descriptor", "stdout-parent", "openat-stdout-dotdot", "fchdir-stdout", "pipe-parent")


# -- network ---------------------------------------------------------------------------------------------------
def test_sockets_of_every_family_fail_and_reach_nothing(host):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0marathon-redteam-{host.token}")
    abstract.listen(8)
    abstract.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = attack(host, rf'''
import socket
attempt("tcp-host", socket.create_connection, ("127.0.0.1", {port}), 1)
attempt("tcp-outside", socket.create_connection, ("1.1.1.1", 53), 1)
attempt("tcp6", socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
attempt("udp", socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
attempt("unix-abstract", lambda: socket.socket(socket.AF_UNIX).connect("\0marathon-redteam-{host.token}"))
attempt("unix-path", lambda: socket.socket(socket.AF_UNIX).connect("/run/dbus/system_bus_socket"))
attempt("netlink", socket.socket, socket.AF_NETLINK, socket.SOCK_RAW, 0)
attempt("packet", socket.socket, socket.AF_PACKET, socket.SOCK_RAW)
attempt("vsock", socket.socket, 40, socket.SOCK_STREAM)      # AF_VSOCK: not namespaced, reaches the hypervisor
attempt("alg", socket.socket, 38, socket.SOCK_SEQPACKET)     # AF_ALG: kernel crypto
attempt("bluetooth", socket.socket, 31, socket.SOCK_STREAM)
attempt("socketpair-inet", socket.socketpair, socket.AF_INET)
raw("raw-socket", 41, 2, 1, 0)                                # socket(AF_INET, SOCK_STREAM) as a raw syscall
raw("raw-socket-x32", 0x40000000 | 41, 2, 1, 0)               # the x32 ABI: the process is killed
''')
        assert r.returncode != 0  # the x32 call killed it (SIGSYS) after everything else was refused
        blocked(r, "tcp-host", "tcp-outside", "tcp6", "udp", "unix-abstract", "unix-path", "netlink", "packet", "vsock",
                "alg", "bluetooth", "socketpair-inet", "raw-socket")
        for s in (listener, abstract):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody connected
    finally:
        listener.close()
        abstract.close()


# -- signals ---------------------------------------------------------------------------------------------------
def test_signals_reach_no_other_process(host):
    sleeper = subprocess.Popen(["sleep", "60"], **({"user": NOBODY, "group": NOBODY} if os.geteuid() == 0 else {}))
    try:
        r = attack(host, rf'''
import signal
attempt("kill-all", os.kill, -1, signal.SIGKILL)
attempt("kill-sleeper", os.kill, {sleeper.pid}, signal.SIGKILL)
attempt("kill-trainer", os.kill, {os.getpid()}, signal.SIGKILL)
attempt("killpg-trainer", os.killpg, {os.getpgid(0)}, signal.SIGKILL)
attempt("pidfd-sleeper", os.pidfd_open, {sleeper.pid})
raw("tgkill-trainer", 234, {os.getpid()}, {os.getpid()}, 9)
raw("ptrace-trainer", 101, 16, {os.getpid()}, 0, 0)
raw("vm-read-trainer", 310, {os.getpid()}, 0, 0, 0, 0, 0)
''')
        blocked(r, "kill-all", "kill-sleeper", "kill-trainer", "killpg-trainer", "pidfd-sleeper", "tgkill-trainer",
                "ptrace-trainer", "vm-read-trainer")
        assert sleeper.poll() is None, "the host process was killed"
    finally:
        sleeper.kill()
        sleeper.wait()


# -- the trainer's environment and files -----------------------------------------------------------------------
def test_the_trainers_environment_is_not_there(host):
    r = attack(host, rf'''
def find(text):
    if "SECRET-{host.token}" in text:
        return text
    raise LookupError("not there")
attempt("environ", lambda: find(repr(dict(os.environ))))
attempt("proc-environ", lambda: find(open("/proc/self/environ").read()))
attempt("init-environ", lambda: find(open("/proc/1/environ").read()))
attempt("cmdline", lambda: find(open("/proc/1/cmdline").read()))
attempt("home", lambda: os.listdir(os.path.expanduser("~/..")) and find(repr(os.listdir("/root"))))
''')
    blocked(r, "environ", "proc-environ", "init-environ", "cmdline", "home")
    assert "ENVSECRET" not in r.stdout + r.stderr


# -- bombs -----------------------------------------------------------------------------------------------------
def test_fork_and_thread_bombs_are_stopped(host):
    r = attack(host, r'''
import threading, time
def fork_bomb():
    while True:
        os.fork()
attempt("fork-bomb", fork_bomb)
n = [0]
def thread_bomb():
    while True:
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        n[0] += 1
        if n[0] > 10000:
            return n[0]
attempt("thread-bomb", thread_bomb)
print("THREADS", n[0], flush=True)
os._exit(0)
''')
    blocked(r, "fork-bomb", "thread-bomb")
    assert int(r.stdout.split("THREADS ")[1].split()[0]) < SandboxLimits().max_procs


def test_memory_bombs_are_stopped(host):
    r = attack(host, r'''
import mmap
attempt("bytearray", bytearray, 8 << 30)
attempt("mmap", mmap.mmap, -1, 8 << 30)
chunks = []
def grow():
    while True:
        chunks.append(bytearray(16 << 20))
attempt("grow", grow)
chunks.clear()
def fill(path):
    for i in range(10000):
        with open(f"{path}/f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
attempt("tmpfs-tmp", fill, "/tmp")
attempt("dev-shm", fill, "/dev/shm")
attempt("root-tmpfs", fill, "/")
''')
    blocked(r, "bytearray", "mmap", "grow", "tmpfs-tmp", "dev-shm", "root-tmpfs")


def test_disk_filling_stops_at_the_cap(host):
    limits = SandboxLimits(timeout_s=30, max_dir_mb=8, max_file_mb=2)
    r = run_python(PRELUDE + r'''
def fill():
    for i in range(100000):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
attempt("fill-dir", fill)
attempt("big-file", lambda: open("/tmp/big", "wb").write(b"x" * (4 << 20)))
attempt("fill-tmp", lambda: [open(f"/tmp/t{i}", "wb").write(b"x" * (2 << 20)) for i in range(100)])
''', host.episode, limits)
    host.check(r, limits)
    blocked(r, "fill-dir", "big-file", "fill-tmp")
    assert 0 < sum(p.stat().st_size for p in host.episode.iterdir()) <= 8 << 20  # what fit came back


def test_an_inode_flood_is_not_copied_back(host, monkeypatch):
    # tmpfs caps bytes, not inodes (bwrap has no nr_inodes option): empty files are bounded by the time limit
    # and vanish with the sandbox; the copy-back refuses more than MAX_ENTRIES of them (lowered here: quicker)
    monkeypatch.setattr(sandbox, "MAX_ENTRIES", 500)
    r = attack(host, "for i in range(600):\n    open(f'e{i}', 'w').close()\nprint('MADE')\n")
    assert "MADE" in r.stdout and r.returncode == 0
    assert sorted(p.name for p in host.episode.iterdir()) == ["numbers.txt"]


# -- time ------------------------------------------------------------------------------------------------------
def test_nothing_outlives_the_time_limit(host):
    limits = SandboxLimits(timeout_s=2)
    t0 = time.monotonic()
    r = run_python(PRELUDE + r'''
import signal, threading, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
attempt("setsid", os.setsid)
attempt("daemon-fork", os.fork)
def scribble():
    i = 0
    while True:
        i += 1
        open("late.txt", "w").write(str(i))
        time.sleep(0.05)
threading.Thread(target=scribble).start()
while True:
    pass
''', host.episode, limits)
    assert r.timed_out and r.returncode is None and time.monotonic() - t0 < 10
    host.check(r, limits)
    blocked(r, "daemon-fork")
    time.sleep(1)
    assert sorted(p.name for p in host.episode.iterdir()) == ["numbers.txt"]  # a killed call changes nothing


def test_cpu_limit_kills_a_busy_loop_that_ignores_signals(host):
    limits = SandboxLimits(timeout_s=1.5)
    r = run_python(PRELUDE + "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
                   host.episode, limits)
    assert r.timed_out
    host.check(r, limits)


# -- what still works ------------------------------------------------------------------------------------------
def test_ordinary_code_still_works_and_files_come_back(host):
    r = run_python("import json, csv, re, threading, tempfile, sqlite3, zoneinfo\n"
                   "print(sum(int(l) for l in open('numbers.txt')))\n"
                   "import os; os.makedirs('out/deep'); open('out/deep/r.json', 'w').write(json.dumps([1, 2]))\n"
                   "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
                   "with tempfile.NamedTemporaryFile() as f: f.write(b'x')\n"
                   "db = sqlite3.connect(':memory:'); print(db.execute('select 6*7').fetchone()[0])\n"
                   "print(os.getuid(), os.getcwd() == os.environ['HOME'], sorted(os.environ))\n",
                   host.episode)
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[:3] == ["6", "thread ok", "42"]
    assert lines[3] == "1000 True ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"
    assert (host.episode / "out" / "deep" / "r.json").read_text() == "[1, 2]"
    assert host.state() == host.before


def test_isolation_reports_the_boundary(boundary):
    assert boundary.kernel and boundary.inside_uid == 1000 and "pid" in boundary.namespaces
    # as root the sandbox runs as the host's nobody (CI runs as root on a kernel that allows it)
    assert boundary.host_uid == (NOBODY if os.geteuid() == 0 else os.geteuid()), boundary.summary
    assert "kernel boundary" in boundary.summary and "seccomp" in boundary.summary
    assert sys.platform == "linux"


# -- where the boundary cannot be built --------------------------------------------------------------------------
def _run_config(tmp_path: Path, env_id: str, **env: object) -> Path:
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "run"), rewards=str(REPO / "rewards" / "default.yaml"))
    cfg["sft"]["steps"] = 0
    cfg["env"] = {"id": env_id, "kwargs": {}, **env}
    path = tmp_path / f"run-{len(list(tmp_path.glob('run-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_runs_using_code_tools_refuse_to_start_without_the_boundary(tmp_path, monkeypatch):
    from configs.schema import ConfigError
    from marathon.driver import prepare

    monkeypatch.setattr(sandbox, "_boundary", lambda: (None, "bubblewrap (bwrap) is not installed"))
    try:
        with pytest.raises(ConfigError) as e:
            prepare(_run_config(tmp_path, "marathon/CodeSandbox-v0"))
        msg = str(e.value)
        assert "\n" not in msg
        assert "env.sandbox: the code sandbox cannot build its kernel boundary here: bubblewrap" in msg
        assert "`env.sandbox: weak`" in msg
        assert isolation().summary.startswith("code sandbox: UNAVAILABLE")
        with pytest.raises(sandbox.SandboxUnavailable):
            run_python("print(1)", tmp_path)
        prepare(_run_config(tmp_path, "marathon/Arithmetic-v0"))  # no code tools: nothing to refuse
        prepare(_run_config(tmp_path, "marathon/CodeSandbox-v0", sandbox="weak"))  # the explicit opt-in
        assert isolation().summary.startswith("code sandbox: WEAK mode (explicitly allowed)")
        assert run_python("print(6 * 7)", tmp_path).stdout == "42\n"
    finally:
        sandbox.allow_weak(False)
        monkeypatch.setattr(sandbox, "_weak_flag", None)
