"""`marathon env list` / `marathon env check`: output and exit codes."""

from __future__ import annotations

from marathon.cli import main


def test_env_list_shows_builtins(capsys):
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    for env_id in ("marathon/Arithmetic-v0", "marathon/Retrieval-v0", "marathon/CodeSandbox-v0"):
        assert env_id in out
    assert "builtin" in out


def test_env_check_reports_oracle_and_random_rates(capsys):
    assert main(["env", "check", "marathon/Arithmetic-v0", "--seeds", "20"]) == 0
    out = capsys.readouterr().out
    assert "oracle success 1.00, random success" in out and "over 20 held-out seeds" in out
    assert out.strip().endswith("OK")


def test_env_check_fails_clearly(capsys):
    assert main(["env", "check", "marathon/Nope-v0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: could not make 'marathon/Nope-v0'" in out and "known ids:" in out
    assert main(["env", "check", "marathon/Arithmetic-v0", "--kwargs", "[1]"]) == 2
    assert main(["env", "check", "marathon/Arithmetic-v0", "--kwargs", '{"difficulty": "nope"}']) == 1
    assert "difficulty must be one of" in capsys.readouterr().out
