"""The learner as a group of ranks (learner/dist.py, learner/data_parallel.py): the token-balanced split, the
DP x CP layout, and 2 ZeRO-3 ranks (gloo, separate processes) training the tiny Marathon model exactly like one
rank, holding half its state each, checkpointing by every rank and resuming, as data-parallel replicas (DP 2) and
as the two context-parallel halves of every packed row (CP 2)."""

from __future__ import annotations

import pytest
import torch

from learner.data_parallel import empty_micro_batch, loss_scale, share, split_by_tokens
from learner.dist import RankLayout, layout_problem
from learner.packing import Sample


def test_split_by_tokens_balances_and_is_deterministic():
    lengths = [50, 10, 40, 30, 30, 20, 5, 5]
    parts = split_by_tokens(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths) and max(loads) <= 70
    assert parts == split_by_tokens(lengths, 3) and all(p == sorted(p) for p in parts)
    assert split_by_tokens([7], 2) == [[0], []]


def test_layout_and_shares():
    assert layout_problem(8, 4) is None and "does not divide" in layout_problem(6, 4)
    layouts = [RankLayout(r, 8, 2) for r in range(8)]
    assert [(x.dp_rank, x.cp_rank) for x in layouts[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[0].dp_size == 4
    samples = [Sample([1] * n, [0] + [1] * (n - 1), [0.0] * n) for n in (9, 3, 7, 5, 6)]
    shares = [share(samples, x) for x in layouts]
    assert shares[0] == shares[1]  # a replica's CP ranks train the same episodes
    assert sorted(i for s in shares[::2] for i in s) == list(range(5))
    blank = empty_micro_batch(samples, packed=True)
    assert blank.num_loss_tokens == 0 and blank.segments == [] and blank.input_ids.shape[1] == 3
    assert loss_scale(accumulation=3, world_size=4, tokens=60) == pytest.approx(0.2)


def _samples(vocab=512):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        L = 20 + 8 * i  # 240 tokens in all: even, so CP 2 adds no padding token (routed, it would count in the
        # MoE balancing statistics: see learner/context_parallel.py)
        ids = torch.randint(10, vocab, (L,), generator=g).tolist()
        out.append(Sample(ids, [0] * 5 + [1] * (L - 5), [0.0] * L, advantage=float(i % 2) - 0.5))
    return out


LR = 3e-5  # small enough that Adam's near-sign first steps do not amplify fp32 summation-order noise


def _train(rank, model_dir, ckpt, zero, foreign_ckpt, cp=1):
    """One rank: 3 updates (an SFT step, then an RL step of 2 PPO updates), state bytes, checkpoint, one more
    update, resume, the same update again; then a checkpoint of another layout, refused."""
    torch.set_num_threads(1)
    from configs.schema import LearnerSection, OptimizerSection
    from learner.engine import Learner

    cfg = LearnerSection(zero_stage=zero, micro_batch_tokens=4096, updates_per_step=2, optimizer=OptimizerSection(lr=LR))
    learner = Learner(model_dir, cfg, seed=0, context_parallel_size=cp)
    samples = _samples()
    for s, lp in zip(samples, learner.sequence_logprobs(samples)):  # on-policy rollout logprobs
        s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
    out = {"layout": str(learner.layout), "stats": [learner.train_sft(samples), learner.train_rl(samples)]}
    out["bytes"] = learner.state_bytes()
    out["weights"] = learner.get_weights()
    learner.save_checkpoint(ckpt, {"step": 3})
    after = learner.train_sft(samples)
    w_after = learner.get_weights()
    assert learner.load_checkpoint(ckpt)["step"] == 3 and learner.updates == 3
    again = learner.train_sft(samples)
    out["resume"] = (after, again, all(torch.equal(w_after[k], v) for k, v in learner.get_weights().items()))
    if foreign_ckpt:
        try:
            learner.load_checkpoint(foreign_ckpt)
        except (ValueError, FileNotFoundError) as e:
            out["refused"] = str(e)
    if rank:
        out.pop("weights")
    return out


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def one_rank(tiny_marathon_dir, tmp_path_factory):
    from learner.dist import spawn_ranks

    ckpt = tmp_path_factory.mktemp("one") / "ckpt1"
    (one,) = spawn_ranks(_train, 1, str(tiny_marathon_dir), str(ckpt), 3, None)
    return one, ckpt


@pytest.mark.parametrize("cp", [1, 2], ids=["dp2", "cp2"])
def test_two_zero3_ranks_train_like_one(tiny_marathon_dir, tmp_path, one_rank, cp):
    """DP 2: each rank trains half the episodes. CP 2: both ranks train every row, each its half of the tokens
    (the row of 6 episodes, 240 tokens, is cut at 120, inside the fourth), the L/S/G layers crossing the cut."""
    from learner.dist import spawn_ranks

    one, ckpt1 = one_rank
    two = spawn_ranks(_train, 2, str(tiny_marathon_dir), str(tmp_path / "ckpt2"), 3, str(ckpt1), cp)
    assert two[1]["layout"].startswith("rank 1/2 (DP 1/2" if cp == 1 else "rank 1/2 (DP 0/1 x CP 1/2")
    for s1, s2 in zip(one["stats"], two[0]["stats"]):
        assert s1["tokens"] == s2["tokens"]
        for key in ("loss", "grad_norm"):
            assert _rel(s2[key], s1[key]) < 1e-5, (key, s1[key], s2[key])
    assert two[0]["stats"] == two[1]["stats"]  # every rank reports the group's statistics
    w1, w2 = one["weights"], two[0]["weights"]
    for k in w1:
        assert (w2[k] - w1[k]).norm() <= 1e-5 * w1[k].norm() + 1e-12, k
    # ZeRO-3 over 2 ranks: each holds about half of the parameters and of the optimizer state
    for b in two:
        ratio = (b["bytes"]["params"] + b["bytes"]["optimizer"]) / (one["bytes"]["params"] + one["bytes"]["optimizer"])
        assert 0.45 < ratio < 0.55, (b["bytes"], one["bytes"])
    # every rank wrote its shards and resumed them: the update after the checkpoint repeats exactly
    for out in (*two, one):
        after, again, same_weights = out["resume"]
        assert after == again and same_weights
    assert len(list((tmp_path / "ckpt2").glob("learner_rank*.pt"))) == 2
    assert len(list((tmp_path / "ckpt2" / "state").glob("zero_pp_rank_*_model_states.pt"))) == 2
    # a checkpoint of another layout is refused by every rank, before any shard is read
    assert "written by 1 learner ranks (CP 1); this group has 2" in two[0]["refused"]
    assert "a checkpoint resumes with the group size it was written by" in two[1]["refused"]


def _selective(rank, model_dir):
    """One rank of a ZeRO-3 DP-2 group, three ways: a fixed recompute_layers (trains), recompute_layers: auto and
    recompute_min_tokens (both refused: each replica would decide by its own rows)."""
    torch.set_num_threads(1)
    from configs.schema import LearnerSection, OptimizerSection
    from learner.engine import Learner

    out = {}
    for name, kw in (("fixed", dict(recompute_layers=1)), ("auto", dict(recompute_layers="auto")),
                     ("min_tokens", dict(recompute_min_tokens=100))):
        cfg = LearnerSection(zero_stage=3, micro_batch_tokens=4096, gradient_checkpointing=True,
                             optimizer=OptimizerSection(lr=LR), **kw)
        try:
            learner = Learner(model_dir, cfg, seed=0)
        except ValueError as e:
            out[name] = str(e)
            continue
        samples = _samples()
        for s, lp in zip(samples, learner.sequence_logprobs(samples)):
            s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
        out[name] = learner.train_rl(samples)["loss"]
    return out


def test_zero3_data_parallel_refuses_only_per_row_recompute(tiny_marathon_dir):
    from learner.dist import spawn_ranks

    ranks = spawn_ranks(_selective, 2, str(tiny_marathon_dir))
    fixed = [r["fixed"] for r in ranks]
    assert isinstance(fixed[0], float) and fixed[0] == fixed[0] and fixed[0] == fixed[1], fixed  # trained, finite
    for r in ranks:
        for name in ("auto", "min_tokens"):
            assert "zero_stage 3 and data parallelism" in r[name], r[name]
