"""Context parallelism (``learner/context_parallel.py``, ``kernels/transition.py``): the state-passing maths at the
kernel level (fp64, exact), then the whole tiny hybrid model (L, S, G, MoE, block attention residuals) split
over CP ranks - simulated as threads of one process, and as real gloo processes on a 4K-token packed row whose
episodes straddle the shard boundaries - against one rank: logprobs and every parameter gradient (fp32)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from kernels import gated_delta_rule, recurrent_gated_delta_rule
from kernels.transition import add_incoming, fold_incoming, shard_pass, transition_reference
from learner.context_parallel import ContextParallel, pad_micro_batch, shard_micro_batch, shard_row, simulate
from learner.dist import free_port
from learner.logprobs import token_logprobs
from learner.packing import Sample, collate

FORWARD_KWARGS = {"cu_seqlens", "routed_experts"}


def _delta_inputs(T: int, H: int = 2, K: int = 16, V: int = 8, dtype=torch.float64, decay: float = 0.1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen, dtype=dtype)
    g = -decay * torch.sigmoid(torch.randn(1, T, H, K, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, dtype=dtype))
    return q, k, v, g, beta


def test_transition_maps_the_entering_state_to_the_final_state():
    q, k, v, g, beta = _delta_inputs(40)
    M = transition_reference(k, g, beta)
    S0 = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    _, with_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    _, from_zero = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(with_state, M @ S0 + from_zero, rtol=0, atol=1e-12)
    assert M.abs().max() > 0.05  # a mild decay: the entering state still matters at the end


def test_shard_pass_returns_the_transition_and_zero_state_run():
    """The augmented kernel run (values [0 | v], initial state [I | 0]) against the token-by-token product."""
    q, k, v, g, beta = _delta_inputs(100)
    run = shard_pass(q, k, v, g, beta, torch.tensor([0, 100]), carries=True)
    o0, h0 = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(run.M, transition_reference(k, g, beta), rtol=0, atol=1e-12)
    torch.testing.assert_close(run.h_ext, h0, rtol=0, atol=1e-12)
    torch.testing.assert_close(run.o, o0, rtol=0, atol=1e-12)
    S0 = torch.randn(2, 16, 8, dtype=torch.float64)
    o_in, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0[None])
    torch.testing.assert_close(add_incoming(run.o, run.q_eff, S0), o_in, rtol=0, atol=1e-12)


def _shards(cu: list[int], T: int, size: int) -> list[tuple[slice, torch.Tensor, bool]]:
    out = []
    for r in range(size):
        s = shard_row(torch.tensor(cu), r, size)
        out.append((slice(s.start, s.end), s.cu_seqlens, s.carried > 0))
    return out


@pytest.mark.parametrize("size", [2, 3, 5])
def test_state_passing_over_shards_matches_the_whole_row_and_its_gradients(size):
    """Shard runs + one exchange of (M, h_ext) + fold + correction == one run over the packed row, outputs and
    gradients (fp64). Sequences end inside shards, one starts exactly on a shard start (120 with 3 and 5
    shards of 120 / 72), one spans several shards."""
    T, cu = 360, [0, 50, 120, 130, 360]
    inputs = [x.requires_grad_() for x in _delta_inputs(T, decay=0.3)]
    w = torch.randn(1, T, 2, 8, dtype=torch.float64)
    ref, _ = gated_delta_rule(*inputs, cu_seqlens=torch.tensor(cu), output_final_state=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs)

    runs = [shard_pass(*(x[:, sl] for x in inputs), lcu, carries) for sl, lcu, carries in _shards(cu, T, size)]
    M, h = torch.cat([r.M for r in runs]), torch.cat([r.h_ext for r in runs])  # what the all-gather carries
    o = torch.cat([add_incoming(r.o, r.q_eff, fold_incoming(M, h, j)) for j, r in enumerate(runs)], dim=1)
    torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad((o * w).sum(), inputs), ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_shard_row_cuts_sequences_and_keeps_global_positions():
    s = shard_row(torch.tensor([0, 3, 8, 16]), 1, 4)  # tokens 4..7: the second sequence from its 2nd token
    assert (s.start, s.end, s.carried, s.first_len) == (4, 8, 1, 4)
    assert s.cu_seqlens.tolist() == [0, 4] and s.pos_in_seg.tolist() == [1, 2, 3, 4]
    s = shard_row(torch.tensor([0, 3, 8, 16]), 2, 4)  # tokens 8..11 start a sequence
    assert (s.carried, s.cu_seqlens.tolist(), s.pos_in_seg.tolist()) == (0, [0, 4], [0, 1, 2, 3])
    s = shard_row(torch.tensor([0, 3, 8, 16]), 0, 2)
    assert (s.carried, s.cu_seqlens.tolist()) == (0, [0, 3, 8])
    with pytest.raises(ValueError, match="equal shards"):
        shard_row(torch.tensor([0, 10]), 0, 4)


def _samples(lengths: list[int], vocab: int, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=gen) < 0.7).long().tolist()
        out.append(Sample(token_ids=torch.randint(1, vocab, (n,), generator=gen).tolist(), loss_mask=mask,
                          logprobs=[0.0] * n, advantage=float(torch.randn(1, generator=gen))))
    return out


def test_micro_batch_padding_and_sharding():
    mb = collate(_samples([5, 6], 50), [0, 1], packed=True)  # 11 tokens
    padded = pad_micro_batch(mb, 4, pad_id=0)
    assert padded.input_ids.shape == (1, 12) and padded.cu_seqlens.tolist() == [0, 5, 11, 12]
    assert padded.loss_mask[0, 11] == 0 and padded.position_ids[0, 11] == 0
    assert padded.num_loss_tokens == mb.num_loss_tokens
    shards = [shard_micro_batch(padded, shard_row(padded.cu_seqlens, r, 2)) for r in range(2)]
    assert [s.cu_seqlens.tolist() for s in shards] == [[0, 5, 6], [0, 5, 6]]
    assert torch.equal(torch.cat([s.position_ids for s in shards], 1), padded.position_ids)
    assert torch.equal(torch.cat([s.targets for s in shards], 1), padded.targets)


def _tiny_model(**overrides):
    from model import MarathonConfig, MarathonForCausalLM

    torch.manual_seed(0)
    config = MarathonConfig.from_preset("tiny", **{"layer_layout": "LSLG", "num_hidden_layers": 4, **overrides})
    return MarathonForCausalLM(config).float().train()


def _reference(model, mb, weights):
    """Logprobs at every position of the packed row and the gradient of sum(weights * logprobs), one rank."""
    model = copy.deepcopy(model)
    logp = token_logprobs(model, mb, FORWARD_KWARGS, all_positions=True)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _routing(model, mb) -> torch.Tensor:
    """The experts one rank routes the row to, for both sides to replay (as the learner replays the rollout's):
    without it a near-tie in a router's top-k, flipped by a 1e-7 difference, would change a token's experts."""
    with torch.no_grad():
        return copy.deepcopy(model)(input_ids=mb.input_ids, position_ids=mb.position_ids, cu_seqlens=mb.cu_seqlens,
                                    return_routed_experts=True).routed_experts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-30))


def _assert_matches(logp, grads, ref_logp, ref_grads, tol=1e-5):
    assert _rel(logp, ref_logp) < tol, _rel(logp, ref_logp)
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert set(grads) == set(ref_grads)
    assert _rel(grads[worst], ref_grads[worst]) < tol, (worst, _rel(grads[worst], ref_grads[worst]))


@pytest.mark.parametrize(
    "lengths, size, window, connected, block",
    [
        ([40, 100, 30, 86], 2, 64, False, None),  # episodes straddle the cut; a shard holds several
        ([40, 100, 30, 86], 4, 64, True, None),  # ranks' graphs joined: one backward (the single-device check)
        ([40, 100, 30, 86], 4, 20, False, 5),  # carried sequences' attention in blocks of 5 queries
        ([3, 5, 8, 2, 6], 4, 13, False, None),  # 6-token shards: the 12-token window and the conv halo span shards
        ([1, 2, 1, 4], 4, 64, False, None),  # 2-token shards: the conv halo spans shards; a sequence starts a shard
    ],
)
def test_simulated_ranks_match_one_rank(one_thread, monkeypatch, lengths, size, window, connected, block):
    if block is not None:
        monkeypatch.setattr("learner.context_parallel.CARRIED_MIN_BLOCK", block)
        monkeypatch.setattr("learner.context_parallel.CARRIED_BLOCK_BYTES", 4 * block)
    model = _tiny_model(sliding_window=window)
    mb = collate(_samples(lengths, model.config.vocab_size), list(range(len(lengths))), packed=True)
    weights = torch.randn(mb.targets.shape, generator=torch.Generator().manual_seed(1))
    ref_logp, ref_grads = _reference(model, mb, weights)
    replicas = [copy.deepcopy(model) for _ in range(size)]

    def rank_main(rank, comm):
        cp = ContextParallel(replicas[rank], comm=comm)
        with cp.sharded(mb) as local:
            logp = token_logprobs(replicas[rank], local, FORWARD_KWARGS, all_positions=True)
            loss = (logp * weights[:, cp.shard.start : cp.shard.end]).sum()
            if not connected:
                loss.backward()
        return logp, loss

    results = simulate(size, rank_main, connected=connected)
    if connected:
        sum(loss for _, loss in results).backward()
    grads = {n: sum(dict(r.named_parameters())[n].grad for r in replicas) for n in ref_grads}
    _assert_matches(torch.cat([lp for lp, _ in results], 1).detach(), grads, ref_logp, ref_grads)


def test_mixers_run_their_own_forward_outside_a_shard():
    model = _tiny_model().eval()  # eval: no routing statistics carried from one forward to the next
    ids = torch.randint(1, 100, (1, 12))
    want = model(input_ids=ids).logits
    cp = simulate(1, lambda rank, comm: ContextParallel(model, comm=comm))[0]
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
    reference = copy.deepcopy(model)  # a patched model copies (the learner's KL reference) and shares the CP
    mixer = reference.model.layers[0].self_attn
    assert mixer.forward.func.__self__ is cp and mixer.forward.args[0] is mixer
    cp.remove()
    assert all("forward" not in vars(m) for m in model.modules())


# -- real ranks: gloo processes ---------------------------------------------------------------------------------

ROW_LENGTHS = [700, 1500, 333, 900, 663]  # 4096 tokens; 2 and 4 shards cut inside sequences, one spans 3 shards


def _gloo_rank(rank: int, world: int, port: int, path: str) -> None:
    """One of 4 gloo processes: CP=4 over the world (gradient checkpointing on), then CP=2 over the pairs
    {0, 1} and {2, 3}; rank 0 saves both results."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        data = torch.load(path, weights_only=False)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        results = {}
        for size, group, checkpointing in [(4, None, True), (2, pairs[rank // 2], False)]:
            model = copy.deepcopy(data["model"])
            if checkpointing:  # the recompute repeats the forward's collectives inside the backward
                model.gradient_checkpointing_enable()
            cp = ContextParallel(model, group)
            with cp.sharded(data["mb"]) as local:
                logp = token_logprobs(model, local, FORWARD_KWARGS, all_positions=True)
                (logp * data["weights"][:, cp.shard.start : cp.shard.end]).sum().backward()
            cp.all_reduce_gradients()
            results[size] = {"logp": cp.gather(logp.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}
        if rank == 0:
            torch.save(results, path + ".out")
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_match_one_rank_on_a_4k_packed_row(tmp_path, one_thread):
    """CP=4 and CP=2 as real processes (gloo), forward + backward with routing replay, against one rank."""
    import torch.multiprocessing as mp

    model = _tiny_model()
    mb = collate(_samples(ROW_LENGTHS, model.config.vocab_size), list(range(len(ROW_LENGTHS))), packed=True)
    assert mb.input_ids.shape[1] == 4096
    mb.routed_experts = _routing(model, mb)
    weights = torch.randn(mb.targets.shape, generator=torch.Generator().manual_seed(1))
    ref_logp, ref_grads = _reference(model, mb, weights)
    path = str(tmp_path / "cp.pt")
    torch.save({"model": model, "mb": mb, "weights": weights}, path)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_gloo_rank, args=(4, free_port(), path), nprocs=4, join=True)
    for size, got in torch.load(path + ".out", weights_only=False).items():
        assert set(got["grads"]) == set(ref_grads), size
        _assert_matches(got["logp"], got["grads"], ref_logp, ref_grads)


# -- the GPU machine: the same maths through the Triton kernel (ranks simulated in one process) -------------------

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dim, dtype", [(64, torch.float32), (128, torch.float32), (128, torch.bfloat16)])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cuda_state_passing_through_the_triton_kernel(mark, size, dim, dtype):
    """Shard runs on augmented values (width 2 * dim: 128 or 256, both Triton head sizes) + fold + correction
    against one Triton run over the packed row: outputs and input gradients, on a 16K-token row."""
    T, cu = 16384, [0, 3000, 4096, 4100, 11000, 16384]
    inputs = [x.cuda().to(dtype).requires_grad_() for x in _delta_inputs(T, H=4, K=dim, V=dim, dtype=torch.float32, decay=5.0)]
    q, k, v, logits, beta = inputs  # bounded gate: g = -5 * sigmoid(logits), fused in the kernel
    kw = dict(bounded_gate=True, gate_lower_bound=-5.0)
    w = torch.randn(1, T, 4, dim, device="cuda")
    ref, _ = gated_delta_rule(*inputs, cu_seqlens=torch.tensor(cu, device="cuda"), output_final_state=True, **kw)
    ref_grads = torch.autograd.grad((ref.float() * w).sum(), inputs)
    runs = [shard_pass(*(x[:, sl] for x in inputs), lcu.cuda(), carries, **kw) for sl, lcu, carries in _shards(cu, T, size)]
    M, h = torch.cat([r.M for r in runs]), torch.cat([r.h_ext for r in runs])
    assert M.dtype == torch.float32 and h.dtype == torch.float32
    o = torch.cat([add_incoming(r.o, r.q_eff, fold_incoming(M, h, j)) for j, r in enumerate(runs)], dim=1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(o.float(), ref.float()) < tol
    for got, want in zip(torch.autograd.grad((o.float() * w).sum(), inputs), ref_grads):
        assert _rel(got.float(), want.float()) < tol


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cuda_simulated_ranks_match_one_rank_on_a_4k_row(mark):
    """The tiny hybrid model on CUDA (KDA through the Triton kernel), CP=4 as threads whose graphs join, fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _tiny_model().cuda()
    mb = collate(_samples(ROW_LENGTHS, model.config.vocab_size), list(range(len(ROW_LENGTHS))), packed=True).to("cuda")
    mb.routed_experts = _routing(model, mb)
    weights = torch.randn(mb.targets.shape, generator=torch.Generator().manual_seed(1)).cuda()
    ref_logp, ref_grads = _reference(model, mb, weights)
    replicas = [copy.deepcopy(model) for _ in range(4)]

    def rank_main(rank, comm):
        cp = ContextParallel(replicas[rank], comm=comm)
        with cp.sharded(mb) as local:
            logp = token_logprobs(replicas[rank], local, FORWARD_KWARGS, all_positions=True)
            return logp, (logp * weights[:, cp.shard.start : cp.shard.end]).sum()

    results = simulate(4, rank_main, connected=True)
    sum(loss for _, loss in results).backward()
    grads = {n: sum(dict(r.named_parameters())[n].grad for r in replicas) for n in ref_grads}
    _assert_matches(torch.cat([lp for lp, _ in results], 1).detach(), grads, ref_logp, ref_grads, tol=1e-4)
