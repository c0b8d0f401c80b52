"""Built-in environments: oracle solves every seed, determinism, seed splits, registry, safety limits."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

import envs
from envs.calculator import CalcError, evaluate
from envs.episodes import RandomPolicy, obs_fingerprint, oracle_policy, run_episode, success_rate
from envs.haystack import Haystack
from envs.sandbox import SandboxLimits, isolation_prefix, network_isolation, run_python

BUILTINS = ["marathon/Arithmetic-v0", "marathon/Retrieval-v0", "marathon/CodeSandbox-v0"]
FAST = {"marathon/Retrieval-v0": {"n_tokens": 20_000}}  # hard = 1M words; the haystack test covers that size


@pytest.mark.parametrize("env_id", BUILTINS)
@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_oracle_solves_every_seed(env_id, difficulty):
    env = envs.make(env_id, difficulty=difficulty, **(FAST.get(env_id, {}) if difficulty == "hard" else {}))
    seeds = envs.train_seeds(4) + envs.heldout_seeds(4) if env_id != "marathon/CodeSandbox-v0" else envs.train_seeds(4)
    assert success_rate(env, oracle_policy, seeds) == 1.0
    assert success_rate(env, RandomPolicy(0), seeds) < 1.0
    env.close()


@pytest.mark.parametrize("env_id", BUILTINS)
def test_same_seed_same_task(env_id):
    env = envs.make(env_id)
    a, b, c = (obs_fingerprint(env.reset(seed=s)[0]) for s in (7, 7, 8))
    assert a == b and a != c
    # the whole oracle transcript is reproducible too
    assert run_episode(env, oracle_policy, 3).messages == run_episode(env, oracle_policy, 3).messages
    env.close()


def test_hard_arithmetic_needs_several_calls_and_easy_is_short():
    hard = run_episode(envs.make("marathon/Arithmetic-v0", difficulty="hard"), oracle_policy, 0)
    assert hard.info["tool_calls"] == 3 and "Let a = " in hard.messages[1]["content"]
    easy = run_episode(envs.make("marathon/Arithmetic-v0"), oracle_policy, 0)
    assert easy.info["tool_calls"] == 1 and easy.steps == 2
    from model.tokenizer import CHAT_TEMPLATE, train_tokenizer  # test-only: envs itself knows no model

    tok = train_tokenizer(512)
    assert tok.chat_template == CHAT_TEMPLATE
    env = envs.make("marathon/Arithmetic-v0")
    texts = [tok.apply_chat_template(run_episode(env, oracle_policy, s).messages, tokenize=False) for s in range(10)]
    lengths = [len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts]
    assert "Final answer:" in texts[0] and 60 < min(lengths) and max(lengths) < 150, lengths


def test_seed_splits_are_disjoint():
    train, held = set(envs.train_seeds(1000)), set(envs.heldout_seeds(1000))
    assert len(train) == len(held) == 1000 and not train & held
    with pytest.raises(ValueError):
        envs.train_seeds(-1)


def test_unknown_id_names_the_known_ids():
    with pytest.raises(envs.UnknownEnvError, match="known ids: .*marathon/Arithmetic-v0"):
        envs.make("marathon/Arithmetc-v0")
    ids = {e.id: e.source for e in envs.list_envs()}
    assert all(ids[i] == "builtin" for i in BUILTINS)


def test_bad_options_are_rejected():
    with pytest.raises(TypeError, match="unknown ArithmeticConfig option"):
        envs.make("marathon/Arithmetic-v0", dificulty="hard")
    with pytest.raises(ValueError, match="difficulty must be one of"):
        envs.make("marathon/Retrieval-v0", difficulty="extreme")
    with pytest.raises(ValueError, match="do not fit"):
        envs.make("marathon/Retrieval-v0", n_tokens=500, distractors=100)
    with pytest.raises(ValueError, match="n_tokens >= words_per_doc"):
        envs.make("marathon/Retrieval-v0", n_tokens=100)
    with pytest.raises(ValueError, match="kinds among"):
        envs.make("marathon/CodeSandbox-v0", kinds=["rm -rf"])


def test_million_token_haystack_streams_fast_in_constant_memory():
    tracemalloc.start()
    start = time.perf_counter()
    stack = Haystack(seed=123, n_words=1_000_000, words_per_doc=500, sentences=[f"The vault code for X{i} is {i}." for i in range(100)])
    total = sum(len(words) for _, _, words in stack.iter_docs())
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 1_000_000 <= total <= 1_000_000 + 800
    assert elapsed < 5.0, elapsed
    assert peak < 2 << 20, peak  # a materialised copy of 1M words would be ~60 MB
    hits = stack.search("X42", k=5)
    assert [h.fact.sentence for h in hits] == ["The vault code for X42 is 42."]
    assert stack.words(hits[0].doc_id)[hits[0].offset:hits[0].offset + 7] == "The vault code for X42 is 42.".split()


def test_retrieval_hard_episode_uses_a_million_words():
    env = envs.make("marathon/Retrieval-v0", difficulty="hard")
    episode = run_episode(env, oracle_policy, 5)
    assert episode.success and env.unwrapped.haystack.n_docs == 2000 and episode.info["tool_calls"] == 6


@pytest.mark.parametrize(
    "expr, value",
    [("12 * (3 + 4)", 84), ("round(2.567, 2)", 2.57), ("7 // 2 + 7 % 2", 4), ("2 ** 10", 1024), ("-3 - -4", 1), ("sqrt(16) + max(1, 5)", 9.0), ("1 / 4", 0.25)],
)
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, message",
    [
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("2 ^ 3", r"use \*\*"),
        ("open('x')", "unknown function"),
        ("x + 1", "unknown name"),
        ("(1).__class__", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("1 +", "invalid expression"),
        ("1" * 600, "longer than"),
        ("(-8) ** 0.5", "complex"),
        ("round(5, -10 ** 9)", "digits must be"),
        ("1e308 * 10", "too large"),
        ("1e200 ** 2", "too large"),
    ],
)
def test_calculator_rejects(expr, message):
    with pytest.raises(CalcError, match=message):
        evaluate(expr)


def test_sandbox_limits(tmp_path):
    limits = SandboxLimits(timeout_s=3, memory_mb=128, max_file_mb=1)
    r = run_python("x = bytearray(512 * 1024 * 1024)", tmp_path, limits)
    assert r.returncode == 1 and "MemoryError" in r.stderr
    r = run_python("open('big', 'wb').write(b'x' * (4 << 20))", tmp_path, limits)
    assert "File too large" in r.stderr
    r = run_python("import socket; socket.create_connection(('127.0.0.1', 80))", tmp_path, limits)
    assert "PermissionError: sandbox: socket" in r.stderr
    r = run_python("import os; os.system('echo hi')", tmp_path, limits)
    assert "not allowed" in r.stderr and "hi" not in r.stdout
    r = run_python("import os, tempfile; print(os.getcwd(), tempfile.gettempdir())", tmp_path, limits)
    assert r.returncode == 0 and r.stdout.split() == [str(tmp_path)] * 2


def test_sandbox_confines_files_to_the_working_directory(tmp_path):
    work, outside = tmp_path / "work", tmp_path / "outside.txt"
    work.mkdir()
    outside.write_text("keep")
    ok = ("import os, shutil, glob, csv, json\nos.makedirs('a/b'); open('a/b/x.txt', 'w').write('1')\n"
          "os.rename('a/b/x.txt', 'y.txt'); shutil.rmtree('a'); os.symlink('y.txt', 'link'); print(open('link').read())")
    r = run_python(ok, work)
    assert r.returncode == 0 and r.stdout.strip() == "1", r
    for code in [
        f"open({str(outside)!r}, 'a').write('x')",
        "open('../outside.txt', 'w')",
        f"import os; os.remove({str(outside)!r})",
        f"import pathlib; pathlib.Path({str(outside)!r}).unlink()",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        f"import os; os.link({str(outside)!r}, 'hard')",
        "import os; os.rename('y.txt', '../moved.txt')",
        f"import os; fd = os.open({str(tmp_path)!r}, os.O_RDONLY)",  # listing/reading outside is refused too
        f"import os; os.symlink({str(outside)!r}, 'sneaky'); open('sneaky').read()",
        "import os; os.chdir('..')",
        "import os; os.kill(1, 0)",
    ]:
        r = run_python(code, work)
        assert r.returncode == 1 and "PermissionError: sandbox:" in r.stderr, (code, r)
    assert outside.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "work"]


@pytest.mark.skipif(network_isolation() != "unshare", reason="no network namespaces here; the audit hook applies")
def test_sandbox_prefix_gives_an_empty_network_namespace():
    read_ifaces = "print([l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])"
    out = subprocess.run([*isolation_prefix(), sys.executable, "-c", read_ifaces], capture_output=True, text=True)
    assert out.stdout.strip() == "['lo']", out


def test_envs_and_rewards_know_no_model():
    code = ("import sys, envs, envs.check, envs.arithmetic, envs.retrieval, envs.code_sandbox, rewards\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'model', 'rollout', 'learner', 'kernels', 'torch'}))")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "[]"


def test_spaces_describe_actions_and_observations():
    env = envs.make("marathon/Retrieval-v0")
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    action = env.action_space.sample()
    assert isinstance(action, str) and env.action_space.contains(action)
    step_obs, *_ = env.step(action)
    assert env.observation_space.contains(step_obs) and not env.observation_space.contains({"messages": "x"})
