"""learner/recompute.py: rows under ``learner.recompute_min_tokens`` run their half-layers once, without
checkpointing, with the gradients of full checkpointing; longer rows are checkpointed (and offloaded) as before;
``learner.recompute_layers`` checkpoints only the first layers of those. model/memory.py's estimate of what an
un-checkpointed layer keeps."""

from __future__ import annotations

import shutil
import weakref

import pydantic
import pytest
import torch

from configs.schema import LearnerSection
from learner import offload, recompute
from learner.packing import Sample
from model import MarathonConfig, MarathonForCausalLM


def _model(checkpointing: bool = True) -> MarathonForCausalLM:
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", sliding_window=16)).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _grads(model: MarathonForCausalLM, ids: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    model(ids, cu_seqlens=cu, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row of episodes of ``lengths`` tokens: ids [1, T], cu_seqlens [N + 1]."""
    g = torch.Generator().manual_seed(sum(lengths))
    return torch.randint(0, 512, (1, sum(lengths)), generator=g), torch.tensor([0, *lengths]).cumsum(0)


def test_short_rows_train_as_with_and_without_checkpointing(one_thread):
    ids, cu = _row([20, 37, 9])  # 66 tokens
    short = _model()
    assert recompute.install(short, min_tokens=67) >= 1
    want_plain, want_ckpt = _grads(_model(checkpointing=False), ids, cu), _grads(_model(), ids, cu)
    for got, plain, ckpt in zip(_grads(short, ids, cu), want_plain, want_ckpt):
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got, ckpt, rtol=1e-5, atol=1e-7)


def _samples(lengths: list[int]) -> list[Sample]:
    g = torch.Generator().manual_seed(len(lengths))
    return [Sample(torch.randint(10, 512, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4), [0.0] * n,
                   advantage=float(i % 2) - 0.5) for i, n in enumerate(lengths)]


def test_half_layers_run_once_on_short_rows_and_twice_on_long_ones(tiny_marathon_dir, one_thread):
    from learner.engine import Learner

    learner = Learner(tiny_marathon_dir, LearnerSection(micro_batch_tokens=256, gradient_checkpointing=True,
                                                        recompute_min_tokens=64))
    calls = {"mixer": 0, "ffn": 0}  # pre-hooks: the non-reentrant recompute may stop before a module's output
    for layer in learner.module.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.__setitem__("mixer", calls["mixer"] + 1))
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("ffn", calls["ffn"] + 1))
    L = learner.module.config.num_hidden_layers
    for lengths, runs in (([20, 30], 1), ([40, 60], 2)):  # one packed row of 50, then of 100 tokens
        calls.update(mixer=0, ffn=0)
        learner.train_rl(_samples(lengths))
        assert calls == {"mixer": runs * L, "ffn": runs * L}, (lengths, calls)


def test_negative_recompute_min_tokens_is_rejected():
    with pytest.raises(pydantic.ValidationError, match="recompute_min_tokens"):
        LearnerSection(recompute_min_tokens=-1)
    assert LearnerSection().recompute_min_tokens == 0


def test_negative_recompute_layers_is_rejected():
    with pytest.raises(pydantic.ValidationError, match="recompute_layers"):
        LearnerSection(recompute_layers=-1)
    with pytest.raises(pydantic.ValidationError, match="recompute_layers"):
        LearnerSection(recompute_layers="some")
    assert LearnerSection().recompute_layers is None
    assert LearnerSection(recompute_layers=0).recompute_layers == 0
    assert LearnerSection(recompute_layers="auto").recompute_layers == "auto"
    with pytest.raises(pydantic.ValidationError, match="recompute_memory_fraction"):
        LearnerSection(recompute_memory_fraction=1.5)


def test_fitting_layers_checkpoints_the_fewest_layers_that_fit():
    """A row's predicted peak falls with each layer checkpointed; ``fitting_layers`` picks the fewest that fit the
    budget (all when none does), the same as a scan from 0, with T rounded up to 16 buckets per power of two."""
    calls = []

    def predict(T: int, k: int) -> int:  # 100 bytes of states, 12 layers keeping 10 - 9 * [checkpointed] per token
        calls.append(T)
        return 100 + T * (10 * 12 - 9 * k)

    pick = recompute.fitting_layers(predict, 12, budget=100_000)
    for T in (1, 700, 900, 1000, 1111, 4000, 10_000, 50_000):
        bucket = -(-T // max(1, 1 << max(0, T.bit_length() - 5))) * max(1, 1 << max(0, T.bit_length() - 5))
        want = next((k for k in range(13) if predict(bucket, k) <= 100_000), 12)
        assert pick(T) == want, (T, bucket)
        assert T <= bucket <= T * 17 / 16
    assert pick(1) == 0 and pick(50_000) == 12  # a short row checkpoints nothing; a row that never fits, all
    n = len(calls)
    assert pick(1000) == pick(1001) and len(calls) == n  # one bucket: searched once


def test_auto_layers_picks_per_row(one_thread):
    """``layers`` as a function of the row's tokens: each row's mixers run twice for its own number of layers."""
    model = _model()
    recompute.install(model, min_tokens=0, layers=lambda T: 1 if T < 60 else 3)
    runs = [0] * model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    for lengths, k in (([20, 30], 1), ([40, 24], 3), ([20, 30], 1)):
        runs[:] = [0] * len(runs)
        _grads(model, *_row(lengths))
        assert runs == [2] * k + [1] * (len(runs) - k), (lengths, runs)
        model.zero_grad(set_to_none=True)


def test_auto_learner_keeps_a_tiny_row_whole(tiny_marathon_dir, one_thread):
    """``recompute_layers: auto`` in the learner: the tiny preset's rows fit many times over in host memory, so no
    layer is checkpointed (each mixer runs once), and the update trains."""
    from learner.engine import Learner

    learner = Learner(tiny_marathon_dir, LearnerSection(micro_batch_tokens=256, gradient_checkpointing=True,
                                                        recompute_layers="auto"))
    calls = [0]
    for layer in learner.module.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    stats = learner.train_rl(_samples([40, 60]))
    assert calls[0] == learner.module.config.num_hidden_layers
    assert stats["loss"] == stats["loss"]  # finite


def test_auto_learner_decides_the_first_micro_batch_without_gradients(tiny_marathon_dir, one_thread):
    """The learner tells ``recompute_layers: auto`` which micro-batch of an update runs: the first (no gradients
    held yet) and the later ones are decided apart, and a recompute decides as its forward did."""
    from learner.engine import Learner

    learner = Learner(tiny_marathon_dir, LearnerSection(micro_batch_tokens=64, gradient_checkpointing=True,
                                                        recompute_layers="auto"))
    auto, L = learner.recompute_layers, learner.module.config.num_hidden_layers
    assert isinstance(auto, recompute.AutoLayers)
    auto._pick = {False: lambda T: 0, True: lambda T: L}  # the first micro-batch keeps every layer, later ones none
    calls = []
    learner.module.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: calls.append(auto.accumulating) if torch.is_grad_enabled() else None)
    stats = learner.train_rl(_samples([40, 60]))  # two micro-batches of at most 64 tokens
    assert calls == [False, True, True]  # the second micro-batch's first mixer runs again in its recompute
    assert stats["loss"] == stats["loss"]


@pytest.mark.parametrize("k", [0, 2])
def test_only_the_first_layers_are_recomputed_with_the_same_gradients(k, one_thread):
    """recompute_layers=k: on a checkpointed row each of the first k layers' mixers runs twice (forward, then
    recompute), the later ones once, every forward alike; a row under recompute_min_tokens runs every layer once.
    The gradients are those of full checkpointing and of none."""
    short, long = _row([20, 30]), _row([40, 24])  # 50 and 64 tokens
    model = _model()
    assert recompute.install(model, min_tokens=64, layers=k) >= 1
    runs = [0] * model.config.num_hidden_layers  # pre-hooks: the non-reentrant recompute may stop early
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    ones = [1] * len(runs)
    for (ids, cu), want in ((short, ones), (long, [2] * k + ones[k:]), (long, [2] * k + ones[k:])):
        runs[:] = [0] * len(runs)
        got = _grads(model, ids, cu)
        assert runs == want, ((ids.shape[1], runs))
        model.zero_grad(set_to_none=True)
    for a, plain, ckpt in zip(got, _grads(_model(checkpointing=False), *long), _grads(_model(), *long)):
        torch.testing.assert_close(a, plain, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a, ckpt, rtol=1e-5, atol=1e-7)


def test_composes_with_offload(monkeypatch, one_thread):
    """Installed outermost: a row under the recompute threshold but over the offload one is neither checkpointed
    nor offloaded; a row over both is both."""
    monkeypatch.setattr(offload, "HOST", torch.device("meta"))  # every CPU tensor counts as a device tensor
    copies = []
    real = offload._host_copy
    monkeypatch.setattr(offload, "_host_copy", lambda t: copies.append(t.shape) or real(t))
    for lengths in ([30, 18], [40, 56]):  # 48 tokens: offload-sized, not checkpointed; 96: both
        ids, cu = _row(lengths)
        both = _model()
        offload.install(both, min_tokens=32)
        recompute.install(both, min_tokens=64)
        copies.clear()
        got = _grads(both, ids, cu)
        checkpointed = sum(lengths) >= 64
        assert (len(copies) >= both.config.num_hidden_layers) if checkpointed else not copies, (lengths, len(copies))
        for a, b in zip(got, _grads(_model(checkpointing=checkpointed), ids, cu)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_layer_activations_estimate_what_a_layer_saves(one_thread):
    """model.memory.layer_activations against the tensors autograd saves (sliding-window layers: attention's CPU
    path saves what flash attention does; the KDA and MLA paths differ off the GPU)."""
    from model.memory import layer_activations

    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", layer_layout="S", sliding_window=16))
    model = model.to(torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}  # storages saved by the current half: bytes
    saved: dict[int, int] = {}  # layer: bytes

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def counted(fn, *args):  # the checkpoint seam: each half runs plainly under saved-tensor hooks
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = fn(*args)
        saved[fn.__self__.layer_idx] = saved.get(fn.__self__.layer_idx, 0) + sum(seen.values())
        return out

    model.model._gradient_checkpointing_func = counted
    ids, cu = _row([100, 156])
    model.model(input_ids=ids, cu_seqlens=cu)
    for i, got in saved.items():
        assert got == pytest.approx(256 * layer_activations(model.config, i, a=2), rel=0.05), i


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="Inductor's CPU backend needs a C++ compiler")
def test_compiled_layer_activations_estimate_what_a_compiled_layer_saves(one_thread):
    """model.memory.layer_activations(compiled=True) against the tensors the compiled token-local modules
    (learner.compile) and the eager rest save, per token: the difference of two row lengths, each storage counted
    once while the graph holds it (a block every later half reads is kept once)."""
    from learner.compile import compile_token_local
    from model.memory import layer_activations

    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", layer_layout="S", sliding_window=16))
    model = model.to(torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    compile_token_local(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[tuple[weakref.ref, int]] = []  # (a saved tensor, its layer)
    layer = [None]

    def counted(fn, *args):  # the checkpoint seam: each half runs plainly under saved-tensor hooks
        layer[0] = fn.__self__.layer_idx
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((weakref.ref(t), layer[0])) or t,
                                                      lambda t: t):
            return fn(*args)

    def per_layer(lengths: list[int]) -> dict[int, int]:
        saved.clear()
        ids, cu = _row(lengths)
        out = model.model(input_ids=ids, cu_seqlens=cu).last_hidden_state
        storages: dict[int, tuple[int, int]] = {}  # data_ptr: (layer, bytes) of the first half to save it
        for ref, i in saved:
            if (t := ref()) is not None and t.untyped_storage().data_ptr() not in params:
                storages.setdefault(t.untyped_storage().data_ptr(), (i, t.untyped_storage().nbytes()))
        del out
        return {i: sum(n for j, n in storages.values() if j == i) for i in range(model.config.num_hidden_layers)}

    model.model._gradient_checkpointing_func = counted
    short, long = per_layer([100, 156]), per_layer([300, 468])  # 256 and 768 tokens
    for i in short:
        got = (long[i] - short[i]) / 512
        # 5-6% over at hidden 128: ~220-320 bytes a layer of small per-token tensors the terms leave out (at
        # learner-bench widths the terms are within 0.3%: model/memory.py)
        assert got == pytest.approx(layer_activations(model.config, i, a=2, compiled=True), rel=0.08), i
        assert got < 0.8 * layer_activations(model.config, i, a=2), i  # the compiled modules keep less


def test_partial_recompute_memory_lies_between_full_and_none():
    """model.memory: k of L layers checkpointed saves more than all, less than none; 0 and L are the two ends."""
    from transformers import LlamaConfig

    from model.memory import learner_memory, learner_memory_bytes

    c, T = MarathonConfig.from_preset("learner-bench"), 65536
    L = c.num_hidden_layers
    full, none = learner_memory_bytes(c, T), learner_memory_bytes(c, T, checkpointing=False)
    for k in (1, L // 2, L - 1):
        part = learner_memory_bytes(c, T, recompute_layers=k)
        assert full["saved_activations"] < part["saved_activations"] < none["saved_activations"], k
        assert full["total"] < part["total"] < none["total"], k
    assert learner_memory_bytes(c, T, recompute_layers=0) == none
    assert learner_memory_bytes(c, T, recompute_layers=L) == full
    assert learner_memory_bytes(c, T, recompute_layers=1, recompute_min_tokens=T + 1) == none  # row not checkpointed
    dense = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        vocab_size=256)
    saved = [learner_memory(dense, T, recompute_layers=k)["saved_activations"] for k in (4, 2, 0)]
    assert saved[0] < saved[1] < saved[2] == learner_memory(dense, T, checkpointing=False)["saved_activations"]


def test_memory_peak_is_the_highest_moment_of_the_update():
    """model.memory: the peak is the end of the forward (saved activations + the head's chunk) with most layers
    kept, a recomputed layer's backward with all checkpointed, and the fp32 gradient copies exist only inside the
    optimizer step (all of them at ZeRO 0-2, one sub-group at a time at ZeRO-3)."""
    from model.memory import HEAD_CHUNK, ZERO3_SUB_GROUP, learner_memory_bytes

    c, T = MarathonConfig.from_preset("learner-bench"), 65536
    head = 3 * HEAD_CHUNK * c.vocab_size * 4 + 2 * T * c.hidden_size * 2
    assert learner_memory_bytes(c, T, recompute_layers=2)["transient"] == head
    full = learner_memory_bytes(c, T)
    assert full["transient"] > head and full["total"] < learner_memory_bytes(c, T, recompute_layers=2)["total"]
    short = learner_memory_bytes(c, 64)  # the step's fp32 gradients outweigh a 64-token row's activations
    P = full["weights"] // 2
    assert full["optimizer"] == 12 * P and full["grads"] == 2 * P
    assert short["saved_activations"] == 0 and short["transient"] == 4 * P  # the activations are gone by the step
    z3 = learner_memory_bytes(c, 64, zero_stage=3)
    assert z3["saved_activations"] + z3["transient"] == 4 * min(P, ZERO3_SUB_GROUP)
    fp32 = learner_memory_bytes(c, 64, bf16=False)
    assert fp32["optimizer"] == 8 * P and fp32["transient"] < 4 * P


def test_first_micro_batch_forward_runs_without_the_gradients():
    """model.memory: an update's first micro-batch (``accumulating`` False) reaches the end of its forward with
    only the head's weight gradient; the later ones with all gradients. The backward and the step hold them all
    either way, and ZeRO-3 is always counted with them."""
    from model.memory import learner_memory_bytes

    c, T = MarathonConfig.from_preset("learner-bench"), 65536
    for k in (2, 7):  # the forward's end is the peak
        held, first = (learner_memory_bytes(c, T, recompute_layers=k, accumulating=a) for a in (True, False))
        assert first["grads"] == c.vocab_size * c.hidden_size * 2 < held["grads"]
        assert held["total"] - first["total"] == held["grads"] - first["grads"]
        assert {n: v for n, v in first.items() if n not in ("grads", "total")} == \
            {n: v for n, v in held.items() if n not in ("grads", "total")}
    # every layer recomputed (a layer's backward is the peak), a 64-token row (the step), ZeRO-3: unchanged
    for tokens, kwargs in ((T, {}), (64, {}), (T, {"recompute_layers": 2, "zero_stage": 3, "dp": 2})):
        assert learner_memory_bytes(c, tokens, accumulating=False, **kwargs) == \
            learner_memory_bytes(c, tokens, **kwargs), (tokens, kwargs)
