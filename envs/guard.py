"""Env faults are data: run an env's ``make`` / ``reset`` / ``step`` under a time limit and turn what goes wrong
into a terminal step instead of an exception.

``GuardedEnv`` is what every rollout path uses (``rollout/runner.py``, the async path): an exception in the env,
a call past its time limit, or a return value that breaks the shape of the contract (``envs/base.py``) ends the
episode with::

    info["infra_failure"] = {"kind": "exception" | "timeout" | "contract", "call": "make" | "reset" | "step",
                             "message": "...", "traceback": "..."}

(the same keys as a dataset env's mid-run verifier failure, ``envs/dataset.py``), ``success`` False, and the env
is not called again (a later ``step`` repeats the failure). The learner leaves such episodes out of their
group's advantage and the driver counts them (``envs/README.md``, "Env faults").

Why a thread and not a subprocess: envs are ordinary in-process objects (tools, caches, handles to sandboxes),
stepped thousands of times per RL step; a subprocess per env would need picklable envs and pay IPC on every
step, and the failures it alone could survive (a C extension that never releases the GIL, a segfault) are not
the ones seen. A hung call is abandoned, not killed (Python cannot stop a thread): its daemon thread runs on
without blocking the run or interpreter exit, the env instance is dropped, and ``abandoned_calls()`` counts
such threads still alive (the driver reports it). A timeout's traceback is the hung thread's stack at the
deadline, which names the line it hangs on. Tools that run code (``envs/sandbox.py``) enforce their own limits
in a process group they can kill; this guard is the outer net for everything else.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
_STDLIB = sysconfig.get_paths()["stdlib"]

KINDS = ("exception", "timeout", "contract")

_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def abandoned_calls() -> int:
    """Threads of timed-out env calls (here and in ``envs.tools``) that are still running."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


@dataclass
class Outcome:
    """What one limited call did: ``value``, or ``error`` (+ its traceback), or it timed out (``timed_out``;
    ``traceback`` is then the hung thread's stack at the deadline)."""

    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    timed_out: bool = False
    where: str = ""  # a timed-out call: the innermost line outside the standard library it was running

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def call_limited(fn: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None, *,
                 timeout_s: float | None, name: str = "env-call") -> Outcome:
    """``fn(*args, **kwargs)`` with a wall-clock limit (a daemon thread; ``timeout_s`` None: inline, no limit).
    Never raises: every exception of ``fn`` (``SystemExit`` included) comes back in the ``Outcome``."""
    kwargs = kwargs or {}
    if timeout_s is None:
        try:
            return Outcome(value=fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - reported
            return Outcome(error=e, traceback=traceback.format_exc())
    box = Outcome()
    done = threading.Event()

    def target() -> None:
        try:
            box.value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported
            box.error, box.traceback = e, traceback.format_exc()
        finally:
            done.set()

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    if done.wait(timeout_s):
        return box
    frame = sys._current_frames().get(thread.ident)
    frames = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()  # None: just ended
    ours = [f for f in frames if not f.filename.startswith(_STDLIB)] or frames
    where = f"{ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name}: {ours[-1].line}" if ours else "?"
    with _abandoned_lock:
        _abandoned.append(thread)
    return Outcome(timed_out=True, where=where,
                   traceback=f"{name} still running after {timeout_s:g} s; its stack:\n" + "".join(frames.format()))


def _shape_problem(call: str, result: Any) -> str | None:
    """The first way ``result`` breaks the shapes the rollout relies on (None: usable). Deliberately the
    structural minimum: ``marathon env check`` holds envs to the whole contract."""
    if call == "reset":
        if not isinstance(result, tuple) or len(result) != 2:
            return "reset must return (obs, info)"
        obs, info = result
    else:
        if not isinstance(result, tuple) or len(result) != 5:
            return "step must return (obs, reward, terminated, truncated, info)"
        obs, info = result[0], result[4]
    if not isinstance(info, dict):
        return f"{call} info must be a dict, got {type(info).__name__}"
    if not isinstance(obs, dict) or not isinstance(obs.get("messages"), list):
        return f"{call} obs must be a dict with a 'messages' list"
    for m in obs["messages"]:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            return f"{call} obs['messages'] holds {m!r:.200}, not {{'role': str, 'content': str}}"
    if call == "reset" and not isinstance(obs.get("tools", []), list):
        return "reset obs['tools'] must be a list"
    return None


def failure_info(kind: str, call: str, message: str, tb: str = "") -> dict[str, Any]:
    """``info["infra_failure"]`` for an env fault (``kind`` one of ``KINDS``)."""
    return {"kind": kind, "call": call, "message": message, "traceback": tb}


class GuardedEnv:
    """An env whose calls cannot raise or hang the caller. ``reset`` returns ``(obs, info)`` and ``step`` the
    usual 5-tuple; after a fault ``self.failure`` is set, ``info["infra_failure"]`` holds it, ``step`` returns
    the terminal ``({"messages": []}, 0.0, True, False, {"success": False, "infra_failure": ...})`` and
    ``reset`` an empty opening ``{"messages": [], "tools": []}``. Not thread-safe for concurrent calls on one
    instance (neither is an env)."""

    def __init__(self, env: Any, timeout_s: float | None = 60.0, label: str = "env") -> None:
        self.env, self.timeout_s, self.label = env, timeout_s, label
        self.failure: dict[str, Any] | None = None

    @classmethod
    def make(cls, env_id: str, kwargs: dict[str, Any] | None = None, timeout_s: float | None = 60.0,
             make_timeout_s: float | None = 600.0, label: str | None = None) -> GuardedEnv:
        """``envs.make(env_id, **kwargs)`` under ``make_timeout_s`` (a dataset env loads its file once per
        process); a failure to make is a fault of the episode, reported by its ``reset``."""
        import envs

        guarded = cls(None, timeout_s, label or env_id)
        out = call_limited(envs.make, (env_id,), kwargs, timeout_s=make_timeout_s, name=f"{guarded.label}.make")
        if out.ok:
            guarded.env = out.value
        else:
            guarded._fail("make", out, make_timeout_s)
            log.warning("%s: make failed (%s): %s", guarded.label, guarded.failure["kind"], guarded.failure["message"])
        return guarded

    # -- the env API ------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        if self.failure is None:
            out = call_limited(self.env.reset, (), {"seed": seed, "options": options}, timeout_s=self.timeout_s,
                               name=f"{self.label}.reset")
            if self._check("reset", out):
                return out.value
        return {"messages": [], "tools": []}, {"seed": seed, "infra_failure": self.failure}

    def step(self, action: str) -> tuple[dict, float, bool, bool, dict]:
        if self.failure is None:
            out = call_limited(self.env.step, (action,), timeout_s=self.timeout_s, name=f"{self.label}.step")
            if self._check("step", out):
                return out.value
        return {"messages": []}, 0.0, True, False, {"success": False, "infra_failure": self.failure}

    def close(self) -> None:
        """Close the env; a failed env is closed in the background (it may be stuck in a call), and an error
        in ``close`` is logged, not raised."""
        env, self.env = self.env, None
        if env is None:
            return
        if self.failure is not None and self.failure["kind"] == "timeout":
            threading.Thread(target=call_limited, args=(env.close,), kwargs={"timeout_s": None},
                             name=f"{self.label}.close", daemon=True).start()
            return
        out = call_limited(env.close, timeout_s=self.timeout_s, name=f"{self.label}.close")
        if not out.ok:
            log.warning("%s: close() failed: %s", self.label, out.traceback.strip().splitlines()[-1:] or "timeout")

    @property
    def unwrapped(self) -> Any:
        return None if self.env is None else self.env.unwrapped

    # -- faults -----------------------------------------------------------------------------------------------
    def _check(self, call: str, out: Outcome) -> bool:
        if out.ok:
            problem = _shape_problem(call, out.value)
            if problem is None:
                return True
            self.failure = failure_info("contract", call, f"{self.label}: {problem}")
        else:
            self._fail(call, out, self.timeout_s)
        log.warning("%s: %s failed (%s): %s", self.label, call, self.failure["kind"], self.failure["message"])
        return False

    def _fail(self, call: str, out: Outcome, limit_s: float | None) -> None:
        if out.timed_out:
            msg = f"{self.label}: {call}() did not return within its {limit_s:g} s limit (at {out.where})"
            self.failure = failure_info("timeout", call, msg, out.traceback)
        else:
            e = out.error
            self.failure = failure_info("exception", call, f"{self.label}: {call}() raised {type(e).__name__}: {e}",
                                        out.traceback)
