"""`marathon bench learner` end to end on CPU (tiny preset), and the learner memory model it prints beside the
measurements."""

from __future__ import annotations

import json

import pytest

from model.config import MarathonConfig
from model.memory import learner_memory_bytes


@pytest.mark.slow  # DeepSpeed start-up, two RL updates and 12 timed layers: minutes on 2 shared cores
def test_bench_learner_runs_small_on_cpu(tmp_path):
    import argparse

    from marathon.commands.bench_learner import add_arguments, main

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--preset", "tiny", "--layouts", "hybrid", "--tokens", "600",
                         "--single", "300", "--episode-tokens", "64,256", "--micro-batch-tokens", "512",
                         "--out", str(tmp_path)])
    assert main(args) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["case"], r["tokens"]) for r in rows] == [("packed", 600), ("single", 300)]
    for r in rows:
        assert r["seconds"] > 0 and r["loss_tokens"] > 0 and r["micro_batches"] >= 1
        assert set(r["layers"]) == {"L", "S", "G", "MoE", "FFN", "head"}
        # the timed update's phases: parts of its wall time
        assert set(r["phases_s"]) == {"collate", "forward", "backward", "step"}
        assert 0 < sum(r["phases_s"].values()) < r["seconds"]
    assert rows[0]["micro_batches"] == 2  # 600 tokens in rows of at most 512: one update of two micro-batches
    md = (tmp_path / "results.md").read_text()
    assert "| hybrid | packed (2 micro-batches) | 600 |" in md and "| hybrid | single | 300 |" in md


def test_memory_trace_marks_each_half_layer_in_forward_recompute_and_backward():
    """``--memory-trace``: every half-layer's forward end, its recompute and the start of its backward, in the
    order they run (the memory figures themselves are the GPU's allocator's, not read on CPU)."""
    import types

    import torch

    from marathon.commands.bench_learner import _memory_trace
    from model.modeling import MarathonForCausalLM

    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny"))
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with _memory_trace(types.SimpleNamespace(module=model), torch.device("cpu")) as events:
        model(input_ids=ids).logits.float().sum().backward()
    halves = [(i, h) for i in range(model.config.num_hidden_layers) for h in ("mixer", "ffn")]
    seen = {kind: [(e["layer"], e["half"]) for e in events if e["event"] == kind]
            for kind in ("forward", "recompute", "backward")}
    assert seen["forward"] == halves
    assert seen["backward"] == seen["recompute"] == halves[::-1]
    # each half's backward starts before its recompute, and the forward ends before any backward
    assert [e["event"] for e in events][len(halves):len(halves) + 2] == ["backward", "recompute"]
    assert all("mixer_half" not in vars(layer) for layer in model.get_decoder().layers)  # unhooked after the block


def test_learner_memory_model_scales_as_documented():
    c = MarathonConfig.from_preset("learner-bench")
    one = learner_memory_bytes(c, 65536)
    assert learner_memory_bytes(c, 4 * 65536)["saved_activations"] == 4 * one["saved_activations"]
    z3 = learner_memory_bytes(c, 65536, zero_stage=3, dp=4)
    for k in ("weights", "grads", "optimizer"):
        assert z3[k] == pytest.approx(one[k] / 4, rel=1e-6)
    assert learner_memory_bytes(c, 4 * 65536, cp=4)["saved_activations"] == one["saved_activations"]
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
