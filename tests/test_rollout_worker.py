"""`RolloutWorker` (a Ray actor around vLLM): ids + logprobs that match the HF model, stop ids, length limits,
and in-place weight updates that the next generation follows."""

from __future__ import annotations

import pytest
import torch

from rollout.worker import GenRequest

pytestmark = pytest.mark.vllm
PROMPTS = [[1, 462, 279, 430, 205, 57, 2, 205], [5, 17, 42, 99, 7], [300, 301, 302]]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()  # [P + T, V]
    lp = logits[len(prompt) - 1 : -1].log_softmax(-1)  # row i predicts ids[i]
    return lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def generate(ray_local, worker, prompts, **kw):
    kw.setdefault("max_new_tokens", 12)
    reqs = [GenRequest(f"r{i}", p, seed=i, **kw) for i, p in enumerate(prompts)]
    return ray_local.get(worker.generate.remote(reqs))


def test_sampled_ids_and_logprobs_match_hf(ray_local, rollout_worker, hf_model):
    results = generate(ray_local, rollout_worker, PROMPTS)
    assert [r.request_id for r in results] == ["r0", "r1", "r2"]
    for prompt, r in zip(PROMPTS, results):
        assert len(r.token_ids) == len(r.logprobs) > 0 and r.policy_version == 0
        ref = hf_logprobs(hf_model, prompt, r.token_ids)
        # fp32 on both sides: only summation order differs
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4


def test_greedy_equals_hf_greedy(ray_local, rollout_worker, hf_model):
    (r,) = generate(ray_local, rollout_worker, PROMPTS[:1], temperature=0.0, max_new_tokens=10)
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert r.token_ids == hf[0, len(PROMPTS[0]) :].tolist()


def test_stop_ids_end_the_turn_and_stay_in_the_output(ray_local, rollout_worker):
    (free,) = generate(ray_local, rollout_worker, PROMPTS[1:2], temperature=0.0, max_new_tokens=12)
    stop = free.token_ids[3]  # whatever greedy emits 4th: stopping must cut right after its first occurrence
    first = free.token_ids.index(stop)
    (cut,) = generate(ray_local, rollout_worker, PROMPTS[1:2], temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[: first + 1], abs=1e-5)


def test_max_new_tokens_and_max_context(ray_local, rollout_worker):
    (short,) = generate(ray_local, rollout_worker, PROMPTS[1:2], max_new_tokens=3, temperature=0.0)
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    limit = 1024  # the fixture's max_model_len: one episode's whole context
    near_full = [7] * (limit - 2)
    full = [7] * limit
    a, b = generate(ray_local, rollout_worker, [near_full, full], max_new_tokens=16)
    assert len(a.token_ids) <= 2 and a.finish_reason in ("context", "stop")
    assert b.token_ids == [] and b.finish_reason == "context"
    with pytest.raises(Exception, match="max_new_tokens"):
        generate(ray_local, rollout_worker, PROMPTS[:1], max_new_tokens=0)


def test_update_weights_changes_what_the_engine_computes(ray_local, rollout_worker, hf_model):
    from rollout.runner import WorkerPool

    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = generate(ray_local, rollout_worker, PROMPTS, temperature=0.0)
    pool = WorkerPool([rollout_worker])
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        (seconds,) = pool.update_weights(hf_model.state_dict(), version=7)
        assert 0 < seconds < 30
        after = generate(ray_local, rollout_worker, PROMPTS, temperature=0.0)
        for prompt, old, new in zip(PROMPTS, before, after):
            assert new.policy_version == 7
            # the new logprobs are the perturbed HF model's, on the new greedy ids...
            assert max(abs(a - b) for a, b in zip(new.logprobs, hf_logprobs(hf_model, prompt, new.token_ids))) < 1e-4
            with torch.no_grad():
                hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
            assert new.token_ids == hf[0, len(prompt) :].tolist()
        # ...and not the old ones (same prompts: the reset prefix cache served no stale KV)
        assert any(o.token_ids != n.token_ids for o, n in zip(before, after))
        assert max(abs(o.logprobs[0] - n.logprobs[0]) for o, n in zip(before, after)) > 1e-2
    finally:
        hf_model.load_state_dict(original)
        ray_local.get(rollout_worker.update_weights.remote(original, 0))
    restored = generate(ray_local, rollout_worker, PROMPTS, temperature=0.0)
    assert [r.token_ids for r in restored] == [r.token_ids for r in before]



def test_split_by_token_budget():
    from rollout.worker import split_by_token_budget

    assert split_by_token_budget([], 10) == []
    assert split_by_token_budget([4, 4, 4], None) == [(0, 3)]
    assert split_by_token_budget([4, 4, 4], 8) == [(0, 2), (2, 3)]
    assert split_by_token_budget([9, 3, 3, 3], 6) == [(0, 1), (1, 3), (3, 4)]  # an over-budget prompt alone


def test_seeded_batch_above_the_prefill_budget(ray_local, tiny_qwen3_dir):
    """On CPU, vLLM crashes ("CPU Generator does not use offset") when a seeded request is prefilled in
    pieces, which happens once a call's prompts exceed one step's token budget. The worker splits such calls;
    the seeded samples equal those of one request at a time."""
    from rollout.worker import WorkerConfig, spawn_worker

    cfg = WorkerConfig(model=str(tiny_qwen3_dir), dtype="float32", max_model_len=256,
                       engine_kwargs={"max_num_batched_tokens": 256})
    worker = spawn_worker(cfg, max_restarts=0)
    try:
        assert ray_local.get(worker.ready.remote())["seeded"]
        reqs = [GenRequest(f"r{i}", [5 + i] * 100, max_new_tokens=8, seed=100 + i) for i in range(4)]  # 400 > 256
        together = ray_local.get(worker.generate.remote(reqs))
        alone = [ray_local.get(worker.generate.remote([r]))[0] for r in reqs]
        assert all(len(r.token_ids) == 8 for r in together)
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    finally:
        ray_local.kill(worker)
