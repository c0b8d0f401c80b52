"""Streamed weight sync (learner/weight_sync.py): buckets, reassembly, streamed HF export, and a learner group on Ray
streaming to a real vLLM rollout worker, which then serves the learner's logprobs; peak memory of both sides."""

from __future__ import annotations

import pytest
import torch

from learner.weight_sync import BucketAssembler, Entry, TensorSink, iter_buckets, plan_buckets, save_hf_streamed


def test_plan_buckets_caps_size_and_splits_large_tensors_by_rows():
    shapes = [("a", (10, 4)), ("b", (3,)), ("big", (50, 4)), ("c", ()), ("d", (7, 4))]
    plan = plan_buckets(shapes, bucket_bytes=64 * 4, elem_bytes=4)  # 64 elements per bucket
    assert all(sum(e.numel for e in b) <= 64 for b in plan)
    for b in plan:  # entries back to back
        assert [e.offset for e in b] == [sum(x.numel for x in b[:i]) for i in range(len(b))]
    rows: dict[str, int] = {}
    for b in plan:
        for e in b:
            assert e.row_start == rows.get(e.name, 0)
            rows[e.name] = e.row_start + e.rows
    assert rows == {"a": 10, "b": 3, "big": 50, "c": 1, "d": 7}
    big = [b for b in plan if any(e.name == "big" for e in b)]
    assert len(big) == 4 and all(len(b) == 1 for b in big)  # 200 elements: in pieces, in buckets of its own
    assert sum(1 for b in plan for e in b if e.name == "d") == 1  # fits a bucket: not split
    wide = plan_buckets([("w", (2, 100))], bucket_bytes=64 * 4, elem_bytes=4)  # one row over the cap: alone
    assert [[(e.row_start, e.rows) for e in b] for b in wide] == [[(0, 1)], [(1, 1)]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_round_trip(dtype):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(300, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    module[2].register_buffer("stat", torch.arange(5.0))
    buckets = list(iter_buckets(module, version=3, bucket_bytes=1024, dtype=dtype))
    assert len(buckets) > 3 and buckets[-1].last and all(b.version == 3 for b in buckets)
    assert max(b.nbytes for b in buckets) <= 1024
    got: dict[str, torch.Tensor] = {}
    asm = BucketAssembler()
    for b in buckets:
        got.update(asm.add(b))
    asm.check_done()
    want = module.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == getattr(torch, dtype) and torch.equal(got[k], v.to(got[k].dtype)), k


def test_assembler_refuses_an_incomplete_stream():
    module = torch.nn.Embedding(64, 8)
    asm = BucketAssembler()
    first = next(iter(iter_buckets(module, bucket_bytes=128, dtype="float32")))
    asm.add(first)
    with pytest.raises(RuntimeError, match="incomplete"):
        asm.check_done()
    assert isinstance(first.entries[0], Entry) and not first.entries[0].whole


def test_save_hf_streamed_writes_a_sharded_checkpoint(tiny_marathon_dir, tmp_path):
    from learner.engine import load_causal_lm

    model = load_causal_lm(tiny_marathon_dir)
    save_hf_streamed(model, tmp_path / "out", model.config, shard_bytes=256 << 10)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 2
    again = load_causal_lm(tmp_path / "out")
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


# -- peak memory -----------------------------------------------------------------------------------------------
def _wide_model(path, hidden=768, vocab=8192, layers=6):
    """~70M-parameter Qwen3 checkpoint (270 MB fp32) whose largest tensors (the MLP's, 9 MB) exceed a bucket."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


# freed buffers go back to the OS at once, so resident memory shows what is alive (see PeakRSS)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@pytest.mark.slow
def test_streamed_sync_peak_memory_and_speed(ray_local, tmp_path):
    """2 ZeRO-3 ranks stream a 270 MB model in 8 MB buckets to two workers: every worker ends with the learner's
    weights, and no process's private memory grows by more than twice the largest tensor (ZeRO-3 gathers whole
    parameters) plus two buckets, far from a model copy; seconds per GB printed."""
    from configs.schema import LearnerSection
    from learner.group import LearnerGroup

    model_dir = _wide_model(tmp_path / "wide")
    cfg = LearnerSection(zero_stage=3, num_ranks=2, num_cpus=0.5, weight_sync_bucket_mb=8)
    group = LearnerGroup(model_dir, cfg, env_vars={"DS_ACCELERATOR": "cpu", **MALLOC})
    try:
        shapes = {k: tuple(v.shape) for k, v in _checkpoint_tensors(model_dir).items()}
        model_bytes = sum(4 * int(torch.Size(s).numel()) for s in shapes.values())
        sink = ray_local.remote(TensorSink).options(num_cpus=0.5, runtime_env={"env_vars": MALLOC})
        workers = [sink.remote(shapes, "float32") for _ in range(2)]
        stats = group.call_all_per_rank("stream_weights", [(workers if i == 0 else None, 1) for i in range(2)],
                                        {"measure_memory": True})
        rank0, peaks = stats[0], ray_local.get([w.peak.remote() for w in workers])
        want = {k: float(v.double().sum()) for k, v in _checkpoint_tensors(model_dir).items()}
        for w in workers:
            assert ray_local.get(w.checksum.remote()) == pytest.approx(want, rel=1e-12)
        mib = 2**20
        print(f"\nmodel {model_bytes / mib:.0f} MiB, largest tensor {rank0['largest_tensor_bytes'] / mib:.0f} MiB, "
              f"{rank0['buckets']} buckets: {rank0['seconds']:.1f} s, {rank0['seconds_per_gb']:.1f} s/GB "
              f"(gather+pack {rank0['pack_seconds']:.1f} s); peak private growth: rank 0 {rank0['peak_rss'] / mib:.0f} "
              f"MiB, rank 1 {stats[1]['peak_rss'] / mib:.0f} MiB, workers {[round(p[0] / mib) for p in peaks]} MiB "
              f"(object-store pages mapped: rank 0 {rank0['peak_shared'] / mib:.0f} MiB, workers "
              f"{[round(p[1] / mib) for p in peaks]} MiB)")
        assert rank0["buckets"] >= model_bytes // (8 * mib)
        # ZeRO-3 gathers whole parameters (on CPU/gloo the all-gather needs up to twice the tensor); a bucket is
        # packed next to it
        bound = 2 * rank0["largest_tensor_bytes"] + 2 * 8 * mib + 16 * mib
        assert rank0["peak_rss"] < bound and stats[1]["peak_rss"] < bound and bound < model_bytes / 3
        assert all(p[0] < bound for p in peaks)
    finally:
        group.shutdown()


def _checkpoint_tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.vllm
def test_streamed_sync_serves_the_learners_weights(ray_local, tiny_marathon_dir):
    """A ZeRO-3 learner group trains the tiny Marathon model, then streams its weights in 64 KiB buckets (expert
    tensors cut across buckets) to a vLLM rollout worker: the worker reports version 1 and samples with the
    learner's logprobs (before the sync it does not)."""
    from configs.schema import LearnerSection
    from learner.group import LearnerGroup
    from learner.packing import Sample
    from rollout.worker import GenRequest, WorkerConfig, spawn_worker

    worker = spawn_worker(WorkerConfig(model=str(tiny_marathon_dir), dtype="float32", max_model_len=256), max_restarts=0)
    group = LearnerGroup(tiny_marathon_dir, LearnerSection(zero_stage=3, num_cpus=0.5), env_vars={"DS_ACCELERATOR": "cpu"})
    try:
        ray_local.get(worker.ready.remote())
        demo = [Sample(list(range(5 + i, 45 + i)), [0] * 5 + [1] * 35, [0.0] * 40) for i in range(4)]
        ray_local.get(group.train_sft.remote(demo, 3e-2))  # weights move far from the served checkpoint
        prompts = [[1, 62, 279, 43, 205], [5, 17, 42, 99, 7, 8]]

        def served_vs_learner():
            reqs = [GenRequest(f"t{i}", p, max_new_tokens=16, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
            results = ray_local.get(worker.generate.remote(reqs))
            samples = [Sample(p + r.token_ids, [0] * len(p) + [1] * len(r.token_ids), [0.0] * len(p) + r.logprobs)
                       for p, r in zip(prompts, results)]
            ours = ray_local.get(group.sequence_logprobs.remote(samples))
            return max(abs(a - b) for s, lp in zip(samples, ours) for a, b, m in zip(lp, s.logprobs, s.loss_mask) if m)

        assert served_vs_learner() > 1e-2
        stats = ray_local.get(group.sync_weights.remote([worker], 1, bucket_bytes=64 << 10))
        assert stats["buckets"] > 10 and stats["version"] == 1
        assert ray_local.get(worker.ready.remote())["version"] == 1
        after = served_vs_learner()
        assert after < 1e-4, after  # fp32 both sides, as tests/test_vllm_plugin.py
    finally:
        group.shutdown()
        ray_local.kill(worker)
