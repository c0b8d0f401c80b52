"""The real stack is installed and works together: vLLM generates, Ray schedules, DeepSpeed steps, gymnasium steps."""

from __future__ import annotations

import math
import time

import pytest


@pytest.mark.vllm
def test_vllm_generates_token_ids_and_logprobs(vllm_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [5, 17, 42, 99, 7]
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=123)
    t0 = time.perf_counter()
    (out,) = vllm_engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    print(f"8 tokens in {time.perf_counter() - t0:.2f}s")
    completion = out.outputs[0]
    assert list(out.prompt_token_ids) == prompt
    assert len(completion.token_ids) == 8
    assert all(0 <= t < 512 for t in completion.token_ids)
    # one logprob dict per sampled token, holding the sampled token's logprob (a real, finite, negative number)
    assert len(completion.logprobs) == 8
    for tok, lp in zip(completion.token_ids, completion.logprobs):
        value = lp[tok].logprob
        assert math.isfinite(value) and value <= 0.0

    # same seed, same sample: the engine is deterministic under a per-request seed
    (again,) = vllm_engine.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    assert list(again.outputs[0].token_ids) == list(completion.token_ids)


def test_ray_runs_remote_tasks(ray_local):
    @ray_local.remote
    def square(x):
        return x * x

    assert ray_local.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]


def test_deepspeed_cpu_step_reduces_loss():
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    }
    from marathon.dist import init_single_process_group

    init_single_process_group()
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    assert engine.device.type == "cpu"
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_gymnasium_env_steps():
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    obs2, reward, terminated, truncated, _ = env.step(0)
    assert obs.shape == obs2.shape == (4,) and reward == 1.0
