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


def test_activation_offload_keeps_gradients_and_frees_device_memory():
    """learner/offload.py: the checkpointed layer inputs live on the host between forward and backward; the
    gradients are those of plain checkpointing, and the memory held after the forward is smaller."""
    from learner import offload

    cfg = dict(hidden_size=512, num_hidden_layers=8, sliding_window=256, attn_residual_block_size=4)
    ids = torch.randint(0, 512, (1, 8192), device="cuda")
    grads, held = [], []
    for use in (False, True):
        model = tiny(**cfg).cuda().train()
        model.gradient_checkpointing_enable()
        if use:
            assert offload.install(model, min_tokens=1024) >= 1
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = model(ids, labels=ids)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - base)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # 8 layers x 2 halves x [8192, 512] fp32 = 256 MiB of layer inputs leave the device
    assert held[1] < held[0] - 200 * 2**20, held


def test_learner_on_cuda_trains_in_bf16(monkeypatch):
    """`learner.Learner` on the GPU: micro-batches on the device, bf16 weights (fp32 masters in DeepSpeed), one
    GRPO update through the Triton kernel changes the weights and keeps them finite."""
    import tempfile

    from deepspeed.accelerator import real_accelerator

    # tests/conftest.py defaults DeepSpeed to the CPU accelerator for the CPU suite: this test wants CUDA's
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)

    from configs.schema import LearnerSection, LossSection
    from learner.engine import Learner
    from learner.packing import Sample

    with tempfile.TemporaryDirectory() as tmp:
        tiny().to(torch.bfloat16).save_pretrained(tmp)
        # the rollout logprobs below (-1.0) are far from the model's (~ -6): the default ratio mask would drop
        # every token (no gradient, no update), so it and the TIS cap are off, as in `marathon bench learner`
        learner = Learner(tmp, LearnerSection(dtype="bfloat16", gradient_checkpointing=True,
                                              offload_activations_tokens=256,
                                              loss=LossSection(tis_cap=None, ratio_mask=None)))
    assert learner.device.type == "cuda" and next(learner.module.parameters()).dtype == torch.bfloat16
    before = [p.detach().clone() for p in learner.module.parameters()]
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(8, 512, (n,), generator=g).tolist(), [0] * 8 + [1] * (n - 8),
                      [-1.0] * n, advantage=a) for n, a in ((300, 1.0), (77, -1.0), (513, 0.5))]
    assert all(mb.input_ids.is_cuda for mb in learner.micro_batches(samples))
    stats = learner.train_rl(samples)
    assert torch.isfinite(torch.tensor(stats["loss"]))
    after = list(learner.module.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_logprob_head_equals_plain_on_cuda(dtype, tol):
    """learner/logprobs.py's token-chunked head (never [T, vocab] logits) against the plain log-softmax on the
    GPU: logprobs and the gradients of the hidden states and the head weight, at a 160K vocabulary."""
    from learner.logprobs import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(256, 163840, bias=False).cuda().to(dtype)
    hidden = (torch.randn(3000, 256, device="cuda") * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, 163840, (3000,), device="cuda")
    plain = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None])[:, 0]
    plain.sum().backward()
    ref = (plain.detach(), hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad = head.weight.grad = None
    chunked = head_logprobs(head, hidden, targets)
    chunked.sum().backward()
    for a, b in zip((chunked.detach(), hidden.grad, head.weight.grad), ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
