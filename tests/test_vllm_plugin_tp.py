"""Tensor parallelism in the vLLM plugin: the tiny Marathon model (LSLG, fp32, MoE) served with TP=2 gives TP=1's
greedy tokens and logprobs, through prefill and decode (linear-attention state, sliding and MLA caches), also
after the learner's full tensors are loaded in place into the running TP=2 engine. Plus the refusal message,
the per-rank weight slices and the CPU thread binding, without an engine."""

from __future__ import annotations

import os

import pytest
import torch

# lengths 6 / 100 / 70, +24 greedy tokens: crosses the 64-token sliding window and the linear layers' 64-token
# chunks; every generated token after the first is a decode step.
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 120)), [300 + (7 * i) % 200 for i in range(70)]]
NEW_TOKENS = 24
# TP=2 differs from TP=1 only in fp32 summation order (each rank's partial o_proj / down_proj sums, then the
# all-reduce): measured max |dlogprob| ~1e-6. A wrong slice or a missing all-reduce moves logprobs by >1e-2.
BOUND = 1e-4


def _greedy(llm) -> list[tuple[list[int], torch.Tensor]]:
    """(ids, logprob of each id) per prompt, greedy."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    res = []
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        res.append((ids, torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ids)])))
    return res


def _max_diff(a, b) -> float:
    """Max |dlogprob| over all prompts; the greedy tokens must be identical."""
    for (ids_a, _), (ids_b, _), p in zip(a, b, PROMPTS):
        assert ids_a == ids_b, f"prompt of {len(p)} tokens: greedy tokens differ"
    return max((la - lb).abs().max().item() for (_, la), (_, lb) in zip(a, b))


@pytest.fixture(scope="module")
def tp2_worker(tiny_marathon_dir):
    """A `RolloutWorker` (in this process) whose engine runs TP=2 on two CPU worker processes: the CPU binding and
    mp executor come from `cpu_tp_engine_kwargs`. The environment it sets (engine core in this process, the
    two-group binding) is restored once the engine runs: a later TP=1 engine here must not inherit them."""
    from rollout.worker import RolloutWorker, WorkerConfig

    keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        worker = RolloutWorker(WorkerConfig(model=str(tiny_marathon_dir), dtype="float32", max_model_len=1024,
                                            tensor_parallel_size=2))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def tp2_engine(tp2_worker):
    return tp2_worker.llm


@pytest.mark.vllm
def test_tp2_matches_tp1(tp2_engine, marathon_engine):
    d = _max_diff(_greedy(tp2_engine), _greedy(marathon_engine))
    print(f"TP=2 vs TP=1 max |dlogprob| = {d:.2e}")
    assert d < BOUND, d


@pytest.mark.vllm
def test_tp2_inplace_update_matches_tp1(tp2_worker, tp2_engine, marathon_engine, tiny_marathon_dir, tmp_path):
    """Full HF tensors loaded into the running TP=2 engine the way `RolloutWorker.update_weights` does (each rank
    takes its slices) serve what a TP=1 engine of the new weights serves. Both engines are restored."""
    from model.modeling import MarathonForCausalLM
    from rollout.vllm_plugin.tiny import write_perturbed

    new = list(write_perturbed(tiny_marathon_dir, tmp_path).state_dict().items())
    old = list(MarathonForCausalLM.from_pretrained(tiny_marathon_dir, dtype=torch.float32).state_dict().items())
    before = _greedy(tp2_engine)
    try:
        tp2_worker.update_weights(new, version=1)  # collective_rpc("marathon_load_weights") + prefix cache reset
        marathon_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)})
        assert marathon_engine.reset_prefix_cache()
        served, reference = _greedy(tp2_engine), _greedy(marathon_engine)
    finally:
        tp2_worker.update_weights(old, version=0)
        marathon_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(tiny_marathon_dir)})
        marathon_engine.reset_prefix_cache()
    d = _max_diff(served, reference)
    print(f"after the in-place update: TP=2 vs TP=1 max |dlogprob| = {d:.2e}")
    assert d < BOUND, d
    moved = max((a - b).abs().max().item() for (_, a), (_, b) in zip(served, before) if a.shape == b.shape)
    assert moved > 100 * BOUND, "the new weights should be visible in the TP=2 engine's logprobs"


@pytest.mark.vllm
def test_tp2_streamed_update_serves_the_streamed_weights(tp2_engine, marathon_engine, tiny_marathon_dir, tmp_path):
    """The learner's streamed sync (`WeightSyncExtension.marathon_stream_*`: vLLM's layerwise reload, buckets of
    full tensors that split layers across buckets) under TP=2: new weights show, and streaming the originals
    back serves TP=1's logprobs again."""
    from model.modeling import MarathonForCausalLM
    from rollout.vllm_plugin.tiny import write_perturbed

    def stream(named):
        tp2_engine.collective_rpc("marathon_stream_begin")
        k = len(named) // 3
        for bucket in (named[:k], named[k : 2 * k], named[2 * k :]):
            tp2_engine.collective_rpc("marathon_stream_load", args=(bucket,))
        tp2_engine.collective_rpc("marathon_stream_finish")
        assert tp2_engine.reset_prefix_cache()

    old = list(MarathonForCausalLM.from_pretrained(tiny_marathon_dir, dtype=torch.float32).state_dict().items())
    reference = _greedy(marathon_engine)
    stream(list(write_perturbed(tiny_marathon_dir, tmp_path, seed=6).state_dict().items()))
    moved = _greedy(tp2_engine)
    stream(old)
    d = _max_diff(_greedy(tp2_engine), reference)
    assert d < BOUND, d
    assert max((a - b).abs().max().item() for (_, a), (_, b) in zip(moved, reference)) > 100 * BOUND


def test_tp_that_does_not_divide_the_model_is_refused_in_one_message():
    from model.config import MarathonConfig
    from rollout.vllm_plugin.tp import check_tp, tp_problem

    tiny = MarathonConfig.from_preset("tiny")
    assert tp_problem(tiny, 1) is None and tp_problem(tiny, 2) is None  # 1 KV head: replicated on both ranks
    assert tp_problem(tiny, 4) == (
        "tensor_parallel_size=4 does not divide the Marathon model's linear_num_heads=2, num_attention_heads=2, "
        "mla_num_heads=2: the vLLM plugin splits heads and FFN widths evenly across TP ranks"
    )
    odd = MarathonConfig.from_preset("tiny", num_attention_heads=6, num_key_value_heads=3, intermediate_size=255,
                                     moe_intermediate_size=63)
    msg = tp_problem(odd, 2)
    for part in ("num_key_value_heads=3 (neither divides the other)", "intermediate_size=255", "moe_intermediate_size=63"):
        assert part in msg, msg
    assert "linear_num_heads" not in tp_problem(MarathonConfig.from_preset("tiny", layer_layout="SG"), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        check_tp(tiny, 4)


@pytest.mark.parametrize("kv_heads, replicas", [(4, 1), (1, 2)])
def test_each_rank_loads_its_slice_of_the_full_tensor(monkeypatch, kv_heads, replicas):
    """KV heads split (4 heads, TP 2: rank r gets heads 2r, 2r+1) or replicated (1 head: both ranks get it)."""
    from rollout.vllm_plugin import tp

    hd, D = 3, 5
    full = torch.arange(kv_heads * hd * D, dtype=torch.float32).view(kv_heads * hd, D)
    local = kv_heads * hd * replicas // 2
    monkeypatch.setattr(tp, "tp_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(tp, "tp_rank", lambda rank=rank: rank)
        param = torch.nn.Parameter(torch.empty(local, D), requires_grad=False)
        tp.shard_loader(0, replicas)(param, full)
        start = (rank // replicas) * local
        assert torch.equal(param, full[start : start + local])
        wide = torch.arange(D * 4, dtype=torch.float32).view(D, 4)  # row-parallel: input columns split
        row = torch.nn.Parameter(torch.empty(D, 2), requires_grad=False)
        tp.shard_loader(1)(row, wide)
        assert torch.equal(row, wide[:, 2 * rank : 2 * rank + 2])
    with pytest.raises(ValueError, match="cannot be split"):
        tp.shard_loader(0)(torch.nn.Parameter(torch.empty(4, D)), full)


def test_cpu_thread_binding_gives_each_rank_its_own_cores():
    from rollout.worker import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [4, 5, 6, 7]) == "4,5|6,7"
    assert cpu_thread_binding(3, range(4)) == "0,1|2|3"
    assert cpu_thread_binding(4, [0, 1]) == "0|1|0|1"  # fewer cores than ranks: shared round-robin
