"""``marathon/Dataset-v0``: tasks from a file, tools and verifier from the config (envs/dataset.py,
envs/config_tools.py, envs/verifiers.py), its errors, ``marathon env check`` on it, SFT demos from reference
solutions, and two RL steps through ``marathon train`` on a generated JSONL file."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

import envs
from envs.check import check_env
from envs.config_tools import SpecError
from envs.parsing import format_call
from envs.seeds import heldout_seeds, train_seeds

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "own_tasks"
ENV_ID = "marathon/Dataset-v0"


def _example_module():
    spec = importlib.util.spec_from_file_location("own_tasks_make", EXAMPLE / "make_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_tasks = _example_module().make_tasks


def example_kwargs(data: Path, **over) -> dict:
    """The example config's env.kwargs, on ``data``."""
    kwargs = yaml.safe_load((EXAMPLE / "config.yaml").read_text())["env"]["kwargs"]
    kwargs["tools"][0]["function"] = str(EXAMPLE / "tools.py") + ":lookup"
    return {**kwargs, "data": str(data), **over}


@pytest.fixture
def tasks(tmp_path) -> Path:
    return make_tasks(tmp_path / "tasks.jsonl", rows=40, heldout=8, seed=1)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int = 12) -> list[dict]:
    return [{"question": f"What is {i} + {i}?", "answer": 2 * i, "reference": f"{2 * i}",
             "split": "test" if i % 4 == 0 else "train"} for i in range(n)]


def play(env, actions: list[str], seed: int):
    env.reset(seed=seed)
    for a in actions:
        out = env.step(a)
    return out


# -- the example ----------------------------------------------------------------------------------------------
def test_example_task_file_plays_and_splits(tasks):
    env = envs.make(ENV_ID, **example_kwargs(tasks))
    obs, info = env.reset(seed=3)
    assert [m["role"] for m in obs["messages"]] == ["system", "user"]
    assert obs["messages"][1]["content"].startswith("What is ") and info["split"] == "train"
    schema = obs["tools"][0]["function"]
    assert schema["name"] == "lookup" and schema["description"].startswith("Look up a person's phone extension")
    assert schema["parameters"]["properties"] == {
        "name": {"type": "string", "description": "the person's first name, as written in the question."}}
    assert schema["parameters"]["required"] == ["name"]  # `directory` is bound to the row: hidden
    row = env.unwrapped.row
    call = format_call("lookup", {"name": row["name"]})
    obs, _, term, _, info = env.step(call)
    assert obs["messages"][0]["content"] == str(row["answer"]) and not term
    obs, _, term, _, info = env.step(f"Final answer: {row['answer']}")
    assert term and info["success"] and info["row"].startswith(str(tasks)) and "infra_failure" not in info
    obs, _, _, _, info = play(env, [format_call("lookup", {"name": "nobody"})], 3)
    assert obs["messages"][0]["content"] == "error: no one named 'nobody' in the directory"
    assert info["call_kinds"] == ["tool_error"]
    # the oracle replays the rows' reference solutions (OpenAI tool_calls, then the final answer)
    from envs.episodes import oracle_policy, run_episode

    assert all(run_episode(env, oracle_policy, s).success for s in [*train_seeds(5), *heldout_seeds(8)])


def test_seeds_map_to_rows_deterministically(tasks):
    env = envs.make(ENV_ID, **example_kwargs(tasks))
    other = envs.make(ENV_ID, **example_kwargs(tasks))
    ts = env.unwrapped.tasks
    assert (ts.size("train"), ts.size("heldout")) == (32, 8)
    rows = []
    for seed in train_seeds(32):
        a, b = env.reset(seed=seed), other.reset(seed=seed)
        assert a[0] == b[0] and a[1]["row"] == b[1]["row"] and a[1]["split"] == "train"
        rows.append(a[1]["row"])
    assert len(set(rows)) == 32  # one pass over the training rows covers each once (shuffled)
    assert rows != sorted(rows, key=lambda r: int(r.split()[-1]))
    held = [env.reset(seed=s)[1] for s in heldout_seeds(8)]
    assert [h["split"] for h in held] == ["heldout"] * 8
    assert [h["row"] for h in held] == [f"{tasks} line {n}" for n in range(33, 41)]  # in order
    assert env.reset(seed=heldout_seeds(9)[8])[1]["row"] == held[0]["row"]  # wraps around
    assert not set(rows) & {h["row"] for h in held}
    assert env.unwrapped.row["split"] == "test"
    unshuffled = envs.make(ENV_ID, **example_kwargs(tasks, shuffle=False))
    assert unshuffled.reset(seed=5)[1]["row"] == f"{tasks} line 6"
    direct = env.reset(options={"split": "heldout", "index": 2})[1]
    assert direct["row"] == held[2]["row"]


# -- formats, prompts, held-out splits ------------------------------------------------------------------------
def test_parquet_csv_json_and_saved_folder(tmp_path):
    import datasets

    rows = qa_rows()
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "t.parquet"))
    (tmp_path / "t.json").write_text(json.dumps(rows))
    with open(tmp_path / "t.csv", "w", newline="") as f:  # messages as JSON text in a CSV cell
        w = csv.DictWriter(f, ["messages", "answer", "split"])
        w.writeheader()
        for r in rows:
            w.writerow({"messages": json.dumps([{"role": "user", "content": r["question"]}]), "answer": r["answer"],
                        "split": r["split"]})
    datasets.DatasetDict({"train": table.filter(lambda r: r["split"] == "train"),
                          "test": table.filter(lambda r: r["split"] == "test")}).save_to_disk(str(tmp_path / "saved"))
    common = {"verifier": "numeric", "heldout": {"column": "split"}}
    for data, extra in [("t.parquet", {"prompt_column": "question"}), ("t.json", {"prompt_template": "{question}"}),
                        ("t.csv", {}), ("saved", {"prompt_column": "question", "heldout": {"split": "test"}})]:
        env = envs.make(ENV_ID, **{**common, **extra, "data": str(tmp_path / data)})
        ts = env.unwrapped.tasks
        assert (ts.size("train"), ts.size("heldout")) == (9, 3), data
        obs, _ = env.reset(seed=heldout_seeds(1)[0])
        assert obs["messages"] == [{"role": "user", "content": "What is 0 + 0?"}], data
        assert obs["tools"] == []
        assert play(env, ["Final answer: 0"], heldout_seeds(1)[0])[4]["success"], data


def test_prompt_sources_system_prompt_and_heldout_kinds(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
             "answer": f"a{i}", "id": i} for i in range(40)]
    main = write_jsonl(tmp_path / "m.jsonl", rows)
    other = write_jsonl(tmp_path / "h.jsonl", [{**r, "id": 100 + r["id"]} for r in rows[:5]])
    env = envs.make(ENV_ID, data=str(main), system_prompt="ignored: the rows have one", heldout=0.25)
    ts = env.unwrapped.tasks
    assert ts.size("train") + ts.size("heldout") == 40 and 0 < ts.size("heldout") < 20
    assert env.reset(seed=0)[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    again = envs.make(ENV_ID, data=str(main), heldout={"fraction": 0.25}).unwrapped.tasks
    assert list(again.heldout[1]) == list(ts.heldout[1])  # hashed: the same rows every time
    by_id = envs.make(ENV_ID, data=str(main), heldout={"fraction": 0.25, "key_column": "id"}).unwrapped.tasks
    assert 0 < by_id.size("heldout") < 40
    two = envs.make(ENV_ID, data=str(main), heldout={"data": str(other)})
    assert (two.unwrapped.tasks.size("train"), two.unwrapped.tasks.size("heldout")) == (40, 5)
    problems, notes = two.unwrapped.check_dataset()  # the same 5 tasks are in both files
    assert any("held-out split leaks: 5 held-out rows" in p for p in problems), problems
    t = envs.make(ENV_ID, data=str(main), prompt_template="Answer {id}", system_prompt="Sys", heldout=0.2)
    assert [m["content"] for m in t.reset(seed=1)[0]["messages"]][0] == "Sys"


# -- tools from config ----------------------------------------------------------------------------------------
TOOL_SOURCE = '''
from typing import Literal, Optional

from envs import ToolError


def convert(value: float, unit: Literal["km", "mi"] = "km", digits: Optional[int] = None, *, note: str = "") -> str:
    """Convert a distance to meters.

    :param value: the distance
    :param unit: its unit
    """
    meters = value * (1000 if unit == "km" else 1609.344)
    return str(round(meters, digits) if digits is not None else meters)


def secret(key: str, table: list) -> dict:
    """Read a row's hidden table."""
    for entry in table:
        if entry["k"] == key:
            return {"key": key, "value": entry["v"]}
    raise ToolError(f"no key {key!r}")


def crash(x: int) -> str:
    """Always fails."""
    return str(1 // (x - x))


def loop() -> str:
    """Never returns."""
    while True:
        pass


def numbers(n: int) -> list:
    """A list."""
    return list(range(n))
'''


@pytest.fixture
def tool_rows(tmp_path):
    (tmp_path / "mytools.py").write_text(TOOL_SOURCE)
    rows = [{"prompt": f"task {i}", "answer": str(i), "table": [{"k": "a", "v": i}, {"k": "b", "v": -i}],
             "split": "test" if i < 2 else "train"} for i in range(8)]
    return write_jsonl(tmp_path / "rows.jsonl", rows)


def test_tools_schema_from_signature_and_calls(tool_rows, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = [{"function": "mytools:convert"},
             {"function": f"{tmp_path}/mytools.py:secret", "name": "lookup", "bind": {"table": "table"}},
             {"function": "mytools:crash"},
             {"function": "envs.calculator:evaluate", "name": "calc"},
             {"function": "mytools:numbers", "description": "Numbers.",
              "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}}]
    env = envs.make(ENV_ID, data=str(tool_rows), heldout={"column": "split"}, tools=tools)
    obs, _ = env.reset(seed=0)
    fns = {t["function"]["name"]: t["function"] for t in obs["tools"]}
    conv = fns["convert"]["parameters"]
    assert fns["convert"]["description"] == "Convert a distance to meters."
    assert conv["properties"] == {
        "value": {"type": "number", "description": "the distance"},
        "unit": {"enum": ["km", "mi"], "default": "km", "description": "its unit"},
        "digits": {"type": ["integer", "null"], "default": None},
        "note": {"type": "string", "default": ""}}
    assert conv["required"] == ["value"] and conv["additionalProperties"] is False
    assert fns["lookup"]["parameters"]["properties"] == {"key": {"type": "string"}}
    assert fns["calc"]["parameters"]["properties"] == {"expression": {"type": "string"}}
    row = env.unwrapped.row
    calls = "".join([format_call("convert", {"value": 2, "unit": "mi", "digits": 1}),
                     format_call("lookup", {"key": "a"}), format_call("lookup", {"key": "zz"}),
                     format_call("crash", {"x": 3}), format_call("calc", {"expression": "6 * 7"}),
                     format_call("numbers", {"n": 3}), format_call("numbers", {"n": 9}),
                     format_call("convert", {"value": "far"})])
    obs, _, _, _, info = env.step(calls)
    out = [m["content"] for m in obs["messages"]]
    assert out[0] == "3218.7"
    assert json.loads(out[1]) == {"key": "a", "value": row["table"][0]["v"]}
    assert out[2] == "error: no key 'zz'"
    assert out[3] == "error: tool 'crash' failed: ZeroDivisionError: integer division or modulo by zero"
    assert out[4] == "42" and out[5] == "[0, 1, 2]"
    assert out[6].startswith("error: bad arguments for tool 'numbers'") and "maximum" in out[6]
    assert out[7].startswith("error: bad arguments for tool 'convert': argument 'value'")
    assert info["call_kinds"] == ["ok", "ok", "tool_error", "tool_error", "ok", "ok", "bad_arguments", "bad_arguments"]


def test_tool_from_an_entry_point(tool_rows, monkeypatch):
    import importlib.metadata as md

    eps = [md.EntryPoint(name="calc", value="envs.calculator:evaluate", group="marathon.tools")]
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda **kw: eps if kw.get("group") == "marathon.tools" else real(**kw))
    env = envs.make(ENV_ID, data=str(tool_rows), heldout={"column": "split"}, tools=[{"entry_point": "calc"}])
    obs, _ = env.reset(seed=0)
    assert obs["tools"][0]["function"]["name"] == "evaluate"
    assert env.step(format_call("evaluate", {"expression": "2 ** 10"}))[0]["messages"][0]["content"] == "1024"


def test_untrusted_tools_run_in_the_sandbox(tool_rows, tmp_path):
    tools = [{"function": f"{tmp_path}/mytools.py:secret", "bind": {"table": "table"}, "untrusted": True},
             {"function": f"{tmp_path}/mytools.py:crash", "untrusted": True},
             {"function": f"{tmp_path}/mytools.py:loop", "untrusted": True, "timeout_s": 1.0}]
    env = envs.make(ENV_ID, data=str(tool_rows), heldout={"column": "split"}, tools=tools)
    obs, _ = env.reset(seed=1)
    assert {t["function"]["name"] for t in obs["tools"]} == {"secret", "crash", "loop"}
    row = env.unwrapped.row
    calls = [format_call("secret", {"key": "b"}), format_call("secret", {"key": "q"}), format_call("crash", {"x": 1}),
             format_call("loop", {})]
    obs, _, _, _, info = env.step("".join(calls))
    out = [m["content"] for m in obs["messages"]]
    assert json.loads(out[0]) == {"key": "b", "value": row["table"][1]["v"]}
    assert out[1] == "error: no key 'q'"  # ToolError from `envs` works in the sandbox (a stand-in module)
    assert out[2].startswith("error: tool 'crash' failed: ZeroDivisionError")
    assert "timed out after 1 s" in out[3]
    assert info["call_kinds"] == ["ok", "tool_error", "tool_error", "timeout"]


# -- verifiers ------------------------------------------------------------------------------------------------
CHECKS = '''
def close_enough(answer, truth, row, margin=0):
    return abs(float(answer) - float(truth)) <= margin + row["slack"]


def score(answer, truth):
    return 0.5 if answer.startswith(str(truth)) else 0.0


def fragile(answer, truth):
    if answer == "boom":
        raise RuntimeError("cannot grade " + answer)
    if answer == "slow":
        import time

        time.sleep(3)
    return answer == str(truth)
'''


@pytest.mark.parametrize("verifier,truth,answers", [
    ("exact", "Paris", {"Paris": True, " Paris ": True, "paris": False}),
    ({"type": "exact", "case_sensitive": False}, "Paris", {"paris": True, "Pariss": False}),
    ("normalized", "The Eiffel Tower!", {"eiffel tower": True, "an Eiffel  tower": True, "tower": False}),
    ("numeric", "1,234", {"1234": True, "it is 1234.0 m": True, "1235": False, "many": False}),
    ({"type": "numeric", "tolerance": 0.5}, 10, {"10.4": True, "9.6": True, "10.6": False}),
    ({"type": "numeric", "rel_tolerance": 0.1}, 100, {"109": True, "111": False}),
    ("regex", r"\d{3}-\d{4}", {"555-1234": True, "call 555-1234": False}),
    ({"type": "regex", "fullmatch": False, "ignore_case": True, "pattern": "yes"}, "x", {"oh YES": True, "no": False}),
    ("exact", ["a", "b"], {"b": True, "c": False}),
    ({"type": "python", "code": "def check(answer, truth, row):\n    return answer[::-1] == truth + row['tag']"},
     "ab", {"xba": True, "ba": False}),
])
def test_builtin_verifiers(tmp_path, verifier, truth, answers):
    data = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "q", "answer": truth, "tag": "x", "split": s}
                                              for s in ("train", "test")])
    env = envs.make(ENV_ID, data=str(data), verifier=verifier, heldout={"column": "split"})
    for answer, expected in answers.items():
        assert play(env, [f"Final answer: {answer}"], 0)[4]["success"] is expected, answer


def test_function_verifiers_trusted_and_sandboxed(tmp_path, monkeypatch):
    (tmp_path / "checks.py").write_text(CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "q", "answer": 10, "slack": 1, "split": s}
                                              for s in ("train", "test")])
    base = {"data": str(data), "heldout": {"column": "split"}}
    for spec in ({"function": "checks:close_enough", "params": {"margin": 1}},
                 {"function": f"{tmp_path}/checks.py:close_enough", "params": {"margin": 1}, "untrusted": True}):
        env = envs.make(ENV_ID, **base, verifier=spec)
        assert play(env, ["Final answer: 12"], 0)[4]["success"]
        assert not play(env, ["Final answer: 12.5"], 0)[4]["success"]
    env = envs.make(ENV_ID, **base, verifier={"function": "checks:score", "threshold": 0.5})
    info = play(env, ["Final answer: 10 exactly"], 0)[4]
    assert info["success"] and info["score"] == 0.5


# -- errors: one message naming the file and row, or the key --------------------------------------------------
def _error(**kwargs) -> str:
    with pytest.raises(SpecError) as e:
        envs.make(ENV_ID, **kwargs)
    return str(e.value)


def test_malformed_rows_and_missing_columns_name_file_and_row(tmp_path, tasks):
    good = tasks.read_text().splitlines()
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text("\n".join([good[0], good[1][:-5], *good[2:]]) + "\n")
    assert _error(**example_kwargs(bad_json)).startswith(f"env.kwargs.data: {bad_json} line 2: not valid JSON: ")
    rows = qa_rows()
    rows[5]["answer"] = "five"
    mixed = write_jsonl(tmp_path / "mixed.jsonl", rows)
    msg = _error(data=str(mixed), prompt_column="question", heldout={"column": "split"})
    assert msg == (f"env.kwargs.data: {mixed} line 6: column 'answer' holds str here but number in {mixed} line 1 "
                   "(a column holds one type of value)")
    rows = [{**r, "answer": str(r["answer"])} for r in qa_rows()]
    rows[3]["answer"] = "three"
    msg = _error(data=str(write_jsonl(tmp_path / "nan.jsonl", rows)), prompt_column="question", verifier="numeric",
                 heldout={"column": "split"})
    assert msg.endswith("nan.jsonl line 4: column 'answer': the numeric verifier needs a number as ground truth, "
                        "got 'three'")
    rows = qa_rows()
    rows[7]["messages"] = [{"role": "assistant", "content": "hi"}]
    rows = [{**r, "messages": r.get("messages", [{"role": "user", "content": r["question"]}])} for r in rows]
    msg = _error(data=str(write_jsonl(tmp_path / "roles.jsonl", rows)), heldout={"column": "split"})
    assert msg.endswith("roles.jsonl line 8: column 'messages': message 0: role must be 'system' or 'user' (the "
                        "task's opening), got 'assistant'")
    rows = qa_rows()
    rows[2]["reference"] = ["<tool_call>{\"name\": \"x\"}</tool_call>"]
    rows = [{**r, "reference": r["reference"] if isinstance(r["reference"], list) else [r["reference"]]} for r in rows]
    msg = _error(data=str(write_jsonl(tmp_path / "ref.jsonl", rows)), prompt_column="question",
                 heldout={"column": "split"})
    assert msg.endswith("ref.jsonl line 3: column 'reference' (reference solution): the last assistant turn of the "
                        "reference is a tool call, not a final answer")
    msg = _error(**example_kwargs(tasks, answer_column="solution"))
    assert msg.startswith("env.kwargs.answer_column: column 'solution' not found in") and "columns: [" in msg
    msg = _error(**example_kwargs(tasks, prompt_template="Where is {city}?"))
    assert msg.startswith("env.kwargs.prompt_template: field(s) ['city'] are not columns of")
    msg = _error(**example_kwargs(tasks, heldout={"column": "fold"}))
    assert msg.startswith("env.kwargs.heldout.column: column 'fold' not found in")
    msg = _error(**example_kwargs(tasks, heldout={"column": "split", "values": ["nope"]}))
    assert msg.startswith("env.kwargs.heldout: the held-out split of") and "is empty" in msg
    assert _error(**example_kwargs(tmp_path / "nope.jsonl")).startswith(
        f"env.kwargs.data: {tmp_path}/nope.jsonl: no such file")
    assert _error(**example_kwargs(tasks, colums=1)).startswith("env.kwargs.colums: unknown option; known: ")
    assert _error(**example_kwargs(tasks, heldout={"fraction": 2})).startswith("env.kwargs.heldout")


def test_tools_that_cannot_load_fail_up_front(tmp_path, tasks):
    def tool_error(spec) -> str:
        return _error(**example_kwargs(tasks, tools=[spec]))

    assert tool_error({"function": "no_such_module_xyz:f"}) == (
        "env.kwargs.tools[0].function: cannot import 'no_such_module_xyz' (ModuleNotFoundError: No module named "
        "'no_such_module_xyz')")
    assert tool_error({"function": "envs.calculator:nope"}) == ("env.kwargs.tools[0].function: module "
                                                                "'envs.calculator' has no attribute 'nope'")
    assert tool_error({"function": "lookup"}).startswith("env.kwargs.tools[0].function: expected 'module:function'")
    assert tool_error({"function": f"{EXAMPLE}/tools.py:lookup", "bind": {"phonebook": "directory"}}).startswith(
        "env.kwargs.tools[0].bind.phonebook: lookup() has no parameter 'phonebook'")
    assert tool_error({"function": f"{EXAMPLE}/tools.py:lookup", "bind": {"directory": "dir"}}).startswith(
        "env.kwargs.tools[0].bind.directory: column 'dir' is not in the data")
    assert tool_error({"function": f"{EXAMPLE}/tools.py:lookup", "tiemout_s": 1}).startswith(
        "env.kwargs.tools[0].tiemout_s: unknown option; known: bind, description, entry_point")
    (tmp_path / "np_tool.py").write_text("import numpy\n\ndef f(x: int) -> str:\n    return str(x)\n")
    msg = tool_error({"function": f"{tmp_path}/np_tool.py:f", "untrusted": True})
    assert msg.startswith(f"env.kwargs.tools[0].function: {tmp_path}/np_tool.py:f does not load in the sandbox "
                          "(standard library only): ModuleNotFoundError: No module named 'numpy'"), msg
    assert tool_error({"entry_point": "no-such-tool"}).startswith(
        "env.kwargs.tools[0].entry_point: no 'marathon.tools' entry point named 'no-such-tool'")


def test_a_raising_verifier_fails_up_front_or_marks_the_episode(tmp_path, monkeypatch):
    (tmp_path / "checks2.py").write_text(CHECKS + "\n\ndef always(answer, truth):\n    raise KeyError('grading key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a module name no other test imports
    data = write_jsonl(tmp_path / "v.jsonl", [{"prompt": f"q{i}", "answer": i, "split": "test" if i == 0 else "train"}
                                              for i in range(4)])
    base = {"data": str(data), "heldout": {"column": "split"}, "shuffle": False}
    msg = _error(**base, verifier={"function": "checks2:always"})
    assert msg == (f"env.kwargs.verifier: verifier checks2:always raised KeyError: 'grading key' on {data} line 2 "
                   "(answer '1')")
    assert _error(**base, verifier="numerc").startswith("env.kwargs.verifier: unknown verifier 'numerc'; built-ins:")
    assert _error(**base, verifier={"type": "numeric", "pattern": "x"}) == (
        "env.kwargs.verifier: 'pattern' applies to type regex only (this verifier is numeric)")
    assert _error(**base, verifier={"function": "checks2:missing"}) == (
        "env.kwargs.verifier.function: module 'checks2' has no attribute 'missing'")
    assert _error(**base, verifier={"type": "python", "code": "import numpy\ndef check(a, t):\n    return True"}) \
        .startswith("env.kwargs.verifier.code: does not load in the sandbox (standard library only): "
                    "ModuleNotFoundError")
    # it passes the up-front rows, then raises mid-run: an infrastructure-failed episode, not a crash
    for spec in ({"function": "checks2:fragile"}, {"function": f"{tmp_path}/checks2.py:fragile", "untrusted": True}):
        env = envs.make(ENV_ID, **base, verifier=spec)
        obs, _, term, trunc, info = play(env, ["Final answer: boom"], 1)
        assert term and not trunc and info["success"] is False
        failure = info["infra_failure"]
        assert (failure["kind"], failure["call"], failure["source"]) == ("exception", "step", "verifier")
        assert failure["message"].startswith(f"{data} line 3: verifier ")
        assert "RuntimeError: cannot grade boom" in failure["message"]
        assert obs == {"messages": [{"role": "tool", "content": f"error: {failure['message']}"}]}
        assert play(env, ["Final answer: 2"], 1)[4]["success"]  # the next episode is fine
    env = envs.make(ENV_ID, **base, verifier={"function": "checks2:fragile", "timeout_s": 0.5})
    failure = play(env, ["Final answer: slow"], 1)[4]["infra_failure"]
    assert failure["kind"] == "timeout" and "did not return within 0.5 s (at " in failure["message"]
    env = envs.make(ENV_ID, **base, verifier={"function": "checks2:score", "timeout_s": 5})
    info = play(env, ["Final answer: 2"], 1)[4]  # a score under the threshold (default 1.0)
    assert info["success"] is False and info["score"] == 0.5


def test_errors_reach_prepare_as_one_config_error(tmp_path, tasks):
    from configs.schema import ConfigError
    from marathon.driver import prepare

    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    cfg["env"]["kwargs"] = example_kwargs(tasks, tools=[{"function": "no_such_module_xyz:lookup"}])
    cfg["rewards"] = str(EXAMPLE / "rewards.yaml")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        prepare(path)
    assert str(e.value) == (f"{path}: env.kwargs.tools[0].function: cannot import 'no_such_module_xyz' "
                            "(ModuleNotFoundError: No module named 'no_such_module_xyz')")
    # no reference solutions: SFT cannot warm-start, and prepare says so before any work
    rows = [{k: v for k, v in json.loads(line).items() if k != "reference"} for line in tasks.read_text().splitlines()]
    bare = write_jsonl(tmp_path / "bare.jsonl", rows)
    cfg["env"]["kwargs"] = {**example_kwargs(bare)}
    cfg["env"]["kwargs"].pop("reference_column")
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"sft.steps: .*bare.jsonl has no reference solutions \(no reference "
                                          r"column\): the SFT warm start needs them"):
        prepare(path)
    assert prepare(path, {"sft.steps": 0}).cfg.sft.steps == 0


# -- marathon env check, SFT demos ------------------------------------------------------------------------------
def test_env_check_on_the_example_config(tmp_path, tasks, capsys):
    from marathon.cli import main

    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    cfg["env"]["kwargs"] = example_kwargs(tasks)
    cfg["rewards"] = str(EXAMPLE / "rewards.yaml")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["env", "check", "--config", str(path), "--seeds", "8"]) == 0
    out = capsys.readouterr().out
    assert "oracle success 1.00, random success 0.00 over 8 held-out seeds" in out
    assert "data: 32 training rows" in out and "8 held-out rows" in out and "heldout.column 'split'" in out
    assert "tool lookup(name), bound from the row: {'directory': 'directory'}" in out
    assert "verifier: numeric; reference solutions: 32 training, 8 held-out rows" in out
    assert out.strip().endswith("OK")
    # a verifier that rejects the references is a problem; so is an oracle that cannot finish
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    rows[-1]["answer"] += 1
    report = check_env(ENV_ID, example_kwargs(write_jsonl(tmp_path / "off.jsonl", rows)), heldout_seeds(8))
    assert any(p.startswith("verifier rejects 1 of 8 heldout reference answers; first: ") and "off.jsonl line 40" in p
               for p in report.problems), report.problems
    assert any(p.startswith("oracle failed on seeds [1000000007]") for p in report.problems)


def test_sft_demos_come_from_reference_rows(tmp_path, tasks, tiny_qwen3_dir):
    from transformers import AutoTokenizer

    from marathon.demos import build_demos, sft_problem
    from rollout.chat import ChatCodec

    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    for r in rows[::2]:
        r["reference"] = None  # half the rows have no reference solution
    data = write_jsonl(tmp_path / "half.jsonl", rows)
    codec = ChatCodec(AutoTokenizer.from_pretrained(tiny_qwen3_dir))
    assert sft_problem(ENV_ID, example_kwargs(data)) is None
    demos = build_demos(ENV_ID, example_kwargs(data), train_seeds(32), codec, 256)
    assert 0 < len(demos) <= 16 and len(demos) == len(set(demos["seed"]))
    text = codec.tokenizer.decode(demos[0]["token_ids"])
    assert '<tool_call>\n{"name": "lookup", "arguments": {"name": ' in text or '{"name": "lookup"' in text
    assert "Final answer: " in text


# -- two RL steps through `marathon train` (acceptance) ----------------------------------------------------------
def test_marathon_train_two_rl_steps_on_a_generated_jsonl(ray_local, tmp_path, capsys):
    """Tools and verifier only in YAML; SFT on the rows' references; evaluation on the held-out rows."""
    from marathon.cli import main

    data = make_tasks(tmp_path / "tasks.jsonl", rows=48, heldout=6, seed=2)
    config = {
        "seed": 0, "output_dir": str(tmp_path / "run"), "rewards": str(EXAMPLE / "rewards.yaml"), "steps": 2,
        "model": {"source": "tiny-qwen3"},
        "env": {"id": ENV_ID, "kwargs": {
            "data": str(data), "prompt_template": "What is {name}'s extension?",
            "system_prompt": "Use the lookup tool, then reply: Final answer: <number>",
            "heldout": {"column": "split", "values": ["test"]},
            "tools": [{"function": f"{EXAMPLE}/tools.py:lookup", "bind": {"directory": "directory"}}],
            "verifier": {"type": "numeric", "tolerance": 0}}},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens_per_turn": 48, "max_episode_tokens": 256,
                    "prefix_caching": False, "max_num_batched_tokens": 32768},
        "learner": {"optimizer": {"lr": 3e-4}, "loss": {"advantage": "rloo"}},
        "sft": {"steps": 1, "batch_size": 8, "num_demos": 16},
        "eval": {"num_seeds": 6, "every": 1},
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--no-progress"]) == 0
    printed = capsys.readouterr().out  # evaluation lines, then the summary
    summary = json.loads(printed[printed.index("{\n"):])
    assert "[eval init] step 0: held-out success" in printed
    out = tmp_path / "run"
    assert summary["step"] == 3 and summary["final_model"] == str(out / "final")
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["sft", "rl", "rl"]
    assert all(float(r["model_tokens"]) > 0 for r in rows[1:])
    evals = json.loads((out / "evals.json").read_text())
    assert set(evals) == {"init", "sft", "main@1", "main"}
    for e in evals.values():  # evaluated on the 6 held-out rows, each once
        assert e["episodes"] == 6 and e["seeds"] == [heldout_seeds(1)[0], heldout_seeds(6)[-1]]
    assert (out / "final" / "config.json").is_file()
