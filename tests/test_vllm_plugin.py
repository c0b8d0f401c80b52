"""The vLLM plugin serves MarathonForCausalLM like the HF model computes it: greedy ids and sampled-token
logprobs on the tiny LSLG config (fp32), also when a prompt's prefix is served from vLLM's prefix cache."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

# lengths 6 / 100 / 70 / 1, +32 generated: crosses the 64-token sliding window and the 64-token chunk of the
# linear layers' chunked prefill; the 100-token prompt prefills more than one chunk.
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 120)), [300 + (7 * i) % 200 for i in range(70)], [42]]
NEW_TOKENS = 32

# fp32 rounding through 4 layers and a 512-way log-softmax: measured mean |diff| ~3e-7, max ~3e-6 (see
# benchmarks/parity). A mis-served detail (a stale or mis-mapped tensor, an off-by-one window) moves
# logprobs by 1e-2 or more, so these bounds keep ~30x margin over noise and ~1000x under a real bug.
MEAN_BOUND, MAX_BOUND = 1e-5, 1e-4


@pytest.fixture(scope="module")
def hf_marathon(tiny_marathon_dir):
    from model.modeling import MarathonForCausalLM

    return MarathonForCausalLM.from_pretrained(tiny_marathon_dir, dtype=torch.float32).eval()


def hf_token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) from one full forward of the HF model."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # [T, vocab]
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_entry_point_registers_the_architecture():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "marathon"]
    ep.load()()
    assert "MarathonForCausalLM" in ModelRegistry.get_supported_archs()


def test_layouts_without_linear_layers_use_the_non_hybrid_class():
    from model.config import MarathonConfig
    from rollout.vllm_plugin.model import serving_architecture

    assert serving_architecture(MarathonConfig(layer_layout="LSLG")) == "MarathonForCausalLM"
    assert serving_architecture(MarathonConfig(layer_layout="SG")) == "MarathonAttnForCausalLM"


def test_greedy_decode_matches_hf(marathon_engine, hf_marathon):
    from vllm import SamplingParams

    outs = marathon_engine.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():  # HF generate: chunked prefill, then one recurrent step per token
            ref = hf_marathon.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert list(out.outputs[0].token_ids) == ref, f"prompt of {len(prompt)} tokens"


def test_sampled_logprobs_match_hf(marathon_engine, hf_marathon):
    from vllm import SamplingParams

    outs = marathon_engine.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, seed=7),
        use_tqdm=False,
    )
    diffs = []
    for prompt, out in zip(PROMPTS, outs):
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        served = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(ids)])
        diffs.append((served - hf_token_logprobs(hf_marathon, prompt, ids)).abs())
    d = torch.cat(diffs)
    assert d.mean() < MEAN_BOUND and d.max() < MAX_BOUND, (d.mean().item(), d.max().item())


def test_prefix_cache_hit_matches_hf(marathon_engine, hf_marathon):
    """A second request extending a served prompt starts from cached KV blocks and cached linear-attention
    states (vLLM's 'align' mamba cache mode); its logprobs must still be the HF model's."""
    from vllm import SamplingParams

    prefix = [(11 * i) % 500 + 3 for i in range(200)]  # > 1 cache block (128 tokens)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    marathon_engine.generate([{"prompt_token_ids": prefix}], params, use_tqdm=False)
    prompt = prefix + [7, 8, 9]
    out = marathon_engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 128, "the second request should hit the prefix cache"
    comp = out.outputs[0]
    served = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)])
    d = (served - hf_token_logprobs(hf_marathon, prompt, list(comp.token_ids))).abs()
    assert d.mean() < MEAN_BOUND and d.max() < MAX_BOUND, (d.mean().item(), d.max().item())


def test_inplace_reload_serves_new_weights(marathon_engine, hf_marathon, tiny_marathon_dir, tmp_path):
    """vLLM's in-place reload (what learner weight sync uses) goes through our load_weights; every tensor,
    the prepacked MoE experts included, must follow the new weights. The engine is restored afterwards."""
    from vllm import SamplingParams

    from rollout.vllm_plugin.tiny import write_perturbed

    perturbed = write_perturbed(tiny_marathon_dir, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompt = PROMPTS[1]
    try:
        marathon_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)})
        comp = marathon_engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        served = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)])
        ids = list(comp.token_ids)
        d_new = (served - hf_token_logprobs(perturbed, prompt, ids)).abs()
        d_old = (served - hf_token_logprobs(hf_marathon, prompt, ids)).abs()
    finally:
        marathon_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(tiny_marathon_dir)})
    assert d_new.mean() < MEAN_BOUND and d_new.max() < MAX_BOUND, (d_new.mean().item(), d_new.max().item())
    assert d_old.mean() > 100 * MEAN_BOUND, "the perturbation should be visible in the logprobs"
