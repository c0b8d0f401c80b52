"""The example plugin package loads through the entry point its pyproject declares, and passes the check."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import envs
from envs import registry
from envs.check import check_env
from marathon.cli import main

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "marathon-env-example"


@pytest.fixture
def plugin(monkeypatch):
    """Make the package importable and its declared entry point visible, as `pip install -e` would."""
    declared = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]["entry-points"][registry.GROUP]
    eps = [importlib.metadata.EntryPoint(name, value, registry.GROUP) for name, value in declared.items()]
    monkeypatch.syspath_prepend(str(PLUGIN))
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: eps if group == registry.GROUP else [])
    monkeypatch.setattr(registry, "_plugin_errors", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    return eps


def test_plugin_is_listed_with_its_source(plugin, capsys):
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert "marathon-example/Inventory-v0" in out and "plugin example (marathon_env_example:register)" in out


def test_plugin_passes_env_check(plugin, capsys):
    assert main(["env", "check", "marathon-example/Inventory-v0", "--seeds", "8"]) == 0
    out = capsys.readouterr().out
    assert "oracle success 1.00" in out and out.strip().endswith("OK")
    env = envs.make("marathon-example/Inventory-v0", n_items=8)
    obs, _ = env.reset(seed=1)
    assert [t["function"]["name"] for t in obs["tools"]] == ["list_items", "count"]


def test_broken_plugin_is_reported_not_fatal(monkeypatch, capsys):
    bad = importlib.metadata.EntryPoint("broken", "no_such_plugin_module:register", registry.GROUP)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [bad])
    monkeypatch.setattr(registry, "_plugin_errors", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert "marathon/Arithmetic-v0" in out
    assert "broken plugin broken: ModuleNotFoundError: No module named 'no_such_plugin_module'" in out


def test_check_catches_a_contract_breaking_env(monkeypatch):
    """An env that raises on a malformed tool call and is not deterministic fails with specific messages."""
    import gymnasium as gym

    class Sloppy(gym.Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.n = 0
            return {"messages": [{"role": "user", "content": str(id(object()))}], "tools": []}, {}

        def step(self, action):
            self.n += 1
            if "<tool_call>" in action:
                raise ValueError("cannot parse")
            return {"messages": []}, 0, self.n > 2, False, {}

    envs.register("marathon-test/Sloppy-v0", entry_point=Sloppy)
    report = check_env("marathon-test/Sloppy-v0", seeds=[0, 1])
    text = "\n".join(report.problems)
    assert not report.ok and report.oracle_rate is None
    assert "not deterministic" in text
    assert "raised ValueError: cannot parse (model mistakes must become observations)" in text
    assert "random episode: step 3 (seed=0, action=" in text and "must hold 'success' as a bool" in text


def test_pip_installed_plugin_is_discovered(tmp_path):
    """A real install (pip, into a target dir) is found through importlib.metadata, no monkeypatching."""
    import shutil
    import subprocess
    import sys

    src, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(PLUGIN, src)  # build artifacts stay out of the repository
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True)
    repo = PLUGIN.parents[1]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{repo}"}
    out = subprocess.run([sys.executable, "-m", "marathon.cli", "env", "check", "marathon-example/Inventory-v0",
                          "--seeds", "3"], capture_output=True, text=True, cwd=repo, env=env)
    assert out.returncode == 0 and "oracle success 1.00" in out.stdout, out.stdout + out.stderr
