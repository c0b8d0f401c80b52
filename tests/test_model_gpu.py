"""The model on CUDA (device machine only; CI has no GPU): the same function as on CPU, the cache on the GPU,
and a bf16 training step at a few thousand tokens through the Triton gated-delta kernel."""

from __future__ import annotations

import pytest
import torch

from model import MarathonCache, MarathonConfig, MarathonForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def tiny(**overrides) -> MarathonForCausalLM:
    torch.manual_seed(0)
    return MarathonForCausalLM(MarathonConfig.from_preset("tiny", **{"sliding_window": 16, **overrides})).eval()


def test_cuda_forward_matches_cpu_and_cache_matches_full():
    cpu = tiny()
    gpu = tiny().cuda()
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        ref = cpu(ids, use_cache=False).logits
        full = gpu(ids.cuda(), use_cache=False).logits
        torch.testing.assert_close(full.cpu(), ref, rtol=1e-4, atol=1e-4)
        cache = MarathonCache(gpu.config)
        steps = [gpu(ids[:, :24].cuda(), past_key_values=cache).logits]
        steps += [gpu(ids[:, t : t + 1].cuda(), past_key_values=cache).logits for t in range(24, 40)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_cuda_packed_rows_match_separate():
    model = tiny().cuda()
    seqs = [torch.randint(0, 512, (1, n), device="cuda") for n in (100, 37, 300)]
    cu = torch.tensor([0, 100, 137, 437], device="cuda")
    with torch.no_grad():
        packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu).logits
        separate = torch.cat([model(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)


def test_bf16_training_step_long_row():
    cfg = dict(hidden_size=512, num_hidden_layers=8, linear_num_heads=8, mla_num_heads=8, num_attention_heads=8,
               num_key_value_heads=2, sliding_window=1024, n_routed_experts=32, num_experts_per_tok=4,
               moe_intermediate_size=256, intermediate_size=1024, attn_residual_block_size=4)
    ref = tiny(**cfg).cuda()
    model = tiny(**cfg).cuda().to(torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 512, (1, 4096), device="cuda")
    out = model(ids, labels=ids, return_routed_experts=True)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():  # bf16 vs fp32 on the same routing: close in distribution
        fp32 = ref(ids, routed_experts=out.routed_experts).logits.float()
        bf16 = model.eval()(ids, routed_experts=out.routed_experts).logits.float()
    rel = (bf16 - fp32).norm() / fp32.norm()
    assert rel < 0.05, rel
