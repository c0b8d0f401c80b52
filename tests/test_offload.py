"""learner/offload.py on CPU: the checkpointed layer inputs change storage after the forward (the GPU test in
tests/test_model_gpu.py moves them to the host for real) and the gradients stay those of plain checkpointing."""

from __future__ import annotations

import torch

from learner import offload
from model import MarathonConfig, MarathonForCausalLM


def _grads(model, ids):
    model(ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_offloaded_checkpoint_inputs_keep_the_gradients(monkeypatch):
    monkeypatch.setattr(offload, "HOST", torch.device("meta"))  # every CPU tensor counts as a device tensor
    swapped = []
    real = offload._host_copy
    monkeypatch.setattr(offload, "_host_copy", lambda t: swapped.append(t.data_ptr()) or real(t))
    ids = torch.randint(0, 512, (1, 96))
    grads = []
    for use in (False, True):
        torch.manual_seed(0)
        model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", sliding_window=16)).train()
        model.gradient_checkpointing_enable()
        if use:
            assert offload.install(model, min_tokens=64) >= 1
        grads.append(_grads(model, ids))
    L = model.config.num_hidden_layers
    assert len(swapped) >= L  # at least one checkpointed input per layer went through the host copy
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_short_rows_are_left_alone(monkeypatch):
    monkeypatch.setattr(offload, "HOST", torch.device("meta"))
    monkeypatch.setattr(offload, "_host_copy", lambda t: (_ for _ in ()).throw(AssertionError("offloaded")))
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", sliding_window=16)).train()
    model.gradient_checkpointing_enable()
    offload.install(model, min_tokens=1000)
    ids = torch.randint(0, 512, (1, 96))
    model(ids, labels=ids).loss.backward()
