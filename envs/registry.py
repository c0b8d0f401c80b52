"""Environment discovery on top of gymnasium's registry: built-ins plus ``marathon.envs`` entry-point plugins.

A plugin package declares, in its pyproject::

    [project.entry-points."marathon.envs"]
    my_envs = "my_pkg.envs:register"     # a callable that registers its envs, or a module that does on import

and registers with ``envs.register(id, entry_point)`` (or ``gymnasium.register`` directly). Ids of the form
``"module:Name-v0"`` also work: gymnasium imports ``module`` first.
"""

from __future__ import annotations

import importlib.metadata
import types
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium.error import UnregisteredEnv

GROUP = "marathon.envs"
BUILTIN = {
    "marathon/Arithmetic-v0": "envs.arithmetic:ArithmeticEnv",
    "marathon/Retrieval-v0": "envs.retrieval:RetrievalEnv",
    "marathon/CodeSandbox-v0": "envs.code_sandbox:CodeSandboxEnv",
    "marathon/Dataset-v0": "envs.dataset:DatasetEnv",  # tasks from a file, tools and verifier from the config
    "marathon/HeavyTail-v0": "envs.heavytail:HeavyTailEnv",  # turns and answer lengths with long tails (benchmarks)
}


class UnknownEnvError(KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class EnvEntry:
    id: str
    source: str  # "builtin", or "plugin <entry point name> (<value>)"
    entry_point: str


_sources: dict[str, str] = {}
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False


def register(env_id: str, entry_point: Any, **kwargs: Any) -> None:
    """Register a text env (no gymnasium wrappers: ``ToolEnv`` checks call order itself, and wrappers
    would hide ``oracle_action``). Re-registering the same id is a no-op."""
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=entry_point, order_enforce=False, disable_env_checker=True, **kwargs)


def register_builtins() -> None:
    for env_id, entry_point in BUILTIN.items():
        register(env_id, entry_point)
        _sources.setdefault(env_id, "builtin")


def load_plugins(force: bool = False) -> dict[str, str]:
    """Load every ``marathon.envs`` entry point once; returns {entry point name: error} for broken ones.
    A broken plugin does not stop the others (``marathon env list`` shows its error)."""
    global _plugins_loaded
    if _plugins_loaded and not force:
        return dict(_plugin_errors)
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=GROUP):
        load_entry_point(ep.name, ep.value, ep.load)
    return dict(_plugin_errors)


def load_entry_point(name: str, value: str, load: Any) -> list[str]:
    """Run one plugin registration (``load`` returns a callable or a module); returns the ids it added."""
    before = set(gym.registry)
    try:
        obj = load()
        if not isinstance(obj, types.ModuleType):
            if not callable(obj):
                raise TypeError(f"entry point {value!r} is neither a module nor a callable")
            obj()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        _plugin_errors[name] = f"{type(e).__name__}: {e}"
        return []
    added = sorted(set(gym.registry) - before)
    for env_id in added:
        _sources[env_id] = f"plugin {name} ({value})"
    return added


def list_envs() -> list[EnvEntry]:
    """Built-in and plugin envs (sorted by id)."""
    register_builtins()
    load_plugins()
    return [
        EnvEntry(env_id, _sources[env_id], str(gym.registry[env_id].entry_point))
        for env_id in sorted(_sources)
        if env_id in gym.registry
    ]


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """Make the env ``env_id`` with ``kwargs`` (its options, e.g. ``difficulty="hard"``)."""
    register_builtins()
    load_plugins()
    try:
        return gym.make(env_id, disable_env_checker=True, **kwargs)
    except UnregisteredEnv as e:
        known = ", ".join(e.id for e in list_envs())
        raise UnknownEnvError(f"unknown environment id {env_id!r} ({e}); known ids: {known}") from None
