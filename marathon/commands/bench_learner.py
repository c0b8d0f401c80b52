"""`marathon bench learner`: one real RL update of a hybrid MoE preset at long context.

Each case is one ``Learner.train_rl`` call (the DeepSpeed engine, GRPO loss, optimizer step, gradient
checkpointing, the token-chunked logprob head) on synthetic episodes: packed episodes summing to each of
``--tokens`` (micro-batches of at most ``--micro-batch-tokens``), and ``--single`` episodes of one sequence each.
Per case: wall time, tokens/s, model TFLOP/s and MFU against the bf16 matmul peak measured in the same run,
peak memory (measured and predicted by ``model.memory.learner_memory_bytes``), and time per layer type: each
kind of layer (L / S / G mixers, the MoE and dense FFNs, the LM head) timed on its own, forward and backward,
on the same row layout, times its count (forward twice for the layers a row checkpoints). ``--layouts hybrid,global``
repeats everything with every mixer a gated MLA layer (same widths), for as long as it fits and a predicted
step stays under ``--max-step-s``. ``--recompute-min-tokens N`` checkpoints only rows of at least N tokens
(``learner.recompute_min_tokens``, learner/recompute.py), ``--recompute-layers K`` only the first K decoder layers
of those rows (``learner.recompute_layers``).

GPU: ``python3 -m marathon.commands.bench_learner --out $OUT`` (DeepSpeed and pydantic travel as wheels; Ray and
vLLM are not needed). CPU: ``marathon bench learner --device cpu --preset tiny --tokens 2048 --single 0``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path


def preset_note(preset: str) -> str:
    """The preset's widths in one line, read from its config: hidden, layers, heads, experts, vocab."""
    from model.config import MarathonConfig

    c = MarathonConfig.from_preset(preset)
    kinds = c.layer_kinds
    return (f"hidden {c.hidden_size}, {len(kinds)} layers {c.layer_layout} ({kinds.count('L')} KDA x "
            f"{c.linear_num_heads} heads of {c.linear_head_k_dim}, {kinds.count('S')} sliding GQA window "
            f"{c.sliding_window}, {kinds.count('G')} gated MLA), {c.n_routed_experts} routed experts top-"
            f"{c.num_experts_per_tok} + {c.n_shared_experts} shared (width {c.moe_intermediate_size}), "
            f"vocab {c.vocab_size}")


def register(subparsers) -> None:
    parser = subparsers.add_parser("learner", help="one RL update of a hybrid MoE preset at 16K-1M tokens (GPU)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="learner-bench", help="model preset (model/config.py)")
    parser.add_argument("--layouts", default="hybrid,global", help="hybrid (the preset's) and/or global (all MLA)")
    parser.add_argument("--tokens", default="16384,65536,262144,1048576", help="packed episodes summing to these")
    parser.add_argument("--single", default="1048576", help="single-episode lengths (0: none)")
    parser.add_argument("--episode-tokens", default="2048,16384", help="min,max length of a packed episode")
    parser.add_argument("--micro-batch-tokens", type=int, default=262144)
    parser.add_argument("--offload-tokens", type=int, default=1048576,
                        help="rows of at least this many tokens keep their checkpointed layer inputs in host memory "
                             "(learner/offload.py; 0: never)")
    parser.add_argument("--recompute-min-tokens", type=int, default=0,
                        help="rows of fewer tokens run without gradient checkpointing, no recompute in backward "
                             "(learner.recompute_min_tokens; learner/recompute.py; 0: every row checkpointed)")
    parser.add_argument("--recompute-layers", type=lambda x: x if x == "auto" else int(x), default=None,
                        help="on a checkpointed row, checkpoint only the first N decoder layers; the later ones keep "
                             "their activations (learner.recompute_layers; default: every layer; 0: none; auto: per "
                             "row, the fewest whose predicted peak fits in 95%% of the device's memory)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2],
                        help="DeepSpeed ZeRO stage of the one-rank learner (learner.zero_stage): nothing is sharded "
                             "on one rank, but each stage steps through its own DeepSpeed optimizer wrapper")
    parser.add_argument("--deepspeed-step", action="store_true",
                        help="bf16 at ZeRO-0: step through DeepSpeed's per-parameter wrapper around torch's AdamW "
                             "(learner.optimizer.flat: false) instead of the learner's FlatAdamW")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model's token-local modules (learner.compile; learner/compile.py)")
    parser.add_argument("--checkpointed-head", action="store_true",
                        help="the logprob head checkpointed and recomputed in backward (learner.fused_head: false) "
                             "instead of computing its gradients in the forward")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--max-step-s", type=float, default=150.0,
                        help="skip a case whose step is predicted (the last case's time scaled by model FLOPs) to "
                             "exceed this")
    parser.add_argument("--repeats", type=int, default=2,
                        help="updates per case; the time reported is the last (steady state), with the phases")
    parser.add_argument("--repeat-max-s", type=float, default=30.0, help="repeat only cases whose update took less")
    parser.add_argument("--layer-times-max-tokens", type=int, default=262144,
                        help="time each layer type on its own only on rows up to this long (0: never)")
    parser.add_argument("--memory-trace", action="store_true",
                        help="record memory at each half-layer's forward, recompute and backward during each case's "
                        "first update (the memory_trace of its row)")
    parser.add_argument("--out", default="benchmarks/learner", help="output folder")


def _episodes(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Episode lengths in [lo, hi] summing to ``total`` (the last one takes the rest)."""
    import random

    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def _samples(lengths: list[int], vocab: int, seed: int):
    """Synthetic agentic episodes: a prompt, then model turns (loss tokens) and tool outputs (not scored),
    groups of 8 with GRPO advantages of random rewards."""
    import torch

    from learner.packing import Sample

    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(len(lengths), generator=g).round()
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(8, vocab, (n,), generator=g).tolist()
        mask = [0] * n
        t = min(n // 10, 1024)  # prompt
        while t < n:
            turn, tool = 512, 256
            mask[t:t + turn] = [1] * len(mask[t:t + turn])
            t += turn + tool
        group = rewards[i - i % 8: i - i % 8 + 8]
        adv = float((rewards[i] - group.mean()) / (group.std() + 1e-6)) if len(group) > 1 else 1.0
        samples.append(Sample(ids, mask[:n], [-1.0 * m for m in mask[:n]], advantage=adv or 0.5))
    return samples


def model_flops(config, lengths: list[int], loss_tokens: int, activated_non_embedding: int) -> float:
    """Model FLOPs of one forward + backward (backward = 2x forward; recompute not counted, as MFU is usually
    defined): 6 N_active per token for the matmul weights (routed experts at top-k), the LM head on the scored
    tokens only, causal MLA attention per sequence, sliding-window attention, and the chunked KDA algorithm."""
    from marathon.commands.bench_kernels import kda_flops

    c, kinds = config, config.layer_kinds
    T = sum(lengths)
    flops = 6.0 * activated_non_embedding * T + 6.0 * c.vocab_size * c.hidden_size * loss_tokens
    d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    for n in lengths:
        flops += kinds.count("G") * 3.0 * n * n * c.mla_num_heads * (d_qk + d_v)  # 2 products, causal half, x3
        w = min(n, c.sliding_window)
        flops += kinds.count("S") * 3.0 * 2 * n * w * c.num_attention_heads * 2 * c.head_dim
        flops += kinds.count("L") * kda_flops(1, n, c.linear_num_heads, c.linear_head_k_dim, c.linear_head_v_dim)
    return flops


def _layer_times(model, mb, device, compiled: bool = False, fused_head: bool = False) -> dict[str, dict[str, float]]:
    """Forward and backward ms of one layer of each kind on this micro-batch's row layout, isolated (on copies,
    so no gradient reaches the engine's parameters); ``compiled``: the head's blocks as ``learner.compile`` runs
    them (the layers' copies carry their compiled methods already); ``fused_head``: the head as
    ``learner.fused_head`` runs it (its gradients in the forward, with a per-token loss of -logp)."""
    import copy

    import torch

    from learner.logprobs import fused_head_loss, head_logprobs
    from model.modeling import _Context

    inner = model.get_decoder()
    T = mb.input_ids.shape[1]
    cu = mb.cu_seqlens.to(device)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff())
    ctx = _Context(mb.position_ids.to(device), None, cu, torch.arange(T, device=device) - cu[seg], None)
    dtype = next(model.parameters()).dtype
    D = model.config.hidden_size

    def timed(fn, *inputs):
        x = [t.detach().requires_grad_() for t in inputs]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else None
        t0 = time.perf_counter()
        if ev:
            ev[0].record()
        out = fn(*x)
        out = out[0] if isinstance(out, tuple) else out
        if ev:
            ev[1].record()
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out) / out.numel())
        if ev:
            ev[2].record()
            torch.cuda.synchronize()
            return {"fwd_ms": ev[0].elapsed_time(ev[1]), "bwd_ms": ev[1].elapsed_time(ev[2])}
        return {"fwd_ms": (t1 - t0) * 1e3, "bwd_ms": (time.perf_counter() - t1) * 1e3}

    x = torch.randn(1, T, D, device=device, dtype=dtype) * 0.5
    out: dict[str, dict[str, float]] = {}
    for layer in inner.layers:
        kind = layer.kind
        if kind in out and ("MoE" if layer.is_moe else "FFN") in out:
            continue
        layer = copy.deepcopy(layer)
        if kind not in out:
            out[kind] = {**timed(lambda h: layer.mix(h, ctx), x), "count": model.config.layer_kinds.count(kind)}
        ffn = "MoE" if layer.is_moe else "FFN"
        if ffn not in out:
            n = sum(1 for m in inner.layers if m.is_moe == layer.is_moe)
            out[ffn] = {**timed(lambda h: layer.ffn(h, None), x), "count": n}
        for m in layer.modules():  # the copy's routing statistics must not reach the next optimizer step
            if hasattr(m, "discard_pending"):
                m.discard_pending()
    rows = int((mb.loss_mask != 0).sum())
    h = torch.randn(rows, D, device=device, dtype=dtype) * 0.5
    targets = mb.targets.to(device).flatten()[(mb.loss_mask.to(device) != 0).flatten()]
    head = copy.deepcopy(model.get_output_embeddings())
    if fused_head:
        rows_idx = torch.arange(rows, device=device)
        out["head"] = {**timed(lambda z: fused_head_loss(head, z, targets, rows_idx, lambda lp, r: -lp,
                                                         compiled=compiled)[0], h), "count": 1}
    else:
        out["head"] = {**timed(lambda z: head_logprobs(head, z, targets, compiled=compiled), h), "count": 1}
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed_update(learner, samples, device) -> tuple[float, dict]:
    t0 = time.perf_counter()
    stats = learner.train_rl(samples)
    _sync(device)
    return time.perf_counter() - t0, stats


@contextmanager
def _phase_times(learner, device):
    """Seconds spent building the micro-batches on the device (collate), in the decoder's forward (the layers, not
    the logprob head), the engine's backward (recompute included) and its optimizer step during the block, the
    device synchronised at each boundary; the rest of an update (the head, the loss) is the difference to its wall
    time."""
    owners = {"collate": (learner, "rank_micro_batches"), "forward": (learner.module.get_decoder(), "forward"),
              "backward": (learner.engine, "backward"), "step": (learner.engine, "step")}
    times = dict.fromkeys(owners, 0.0)

    def timed(name, fn):
        def run(*args, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(device)
            times[name] += time.perf_counter() - t0
            return out
        return run

    with _wrapped({(owner, attr): lambda fn, name=name: timed(name, fn) for name, (owner, attr) in owners.items()}):
        yield times


@contextmanager
def _wrapped(wrappers: dict):
    """Inside the block, each instance method ``owner.attr`` of ``wrappers`` ({(owner, attr): wrap}) is replaced
    by ``wrap(method)``; after it, the class's methods again."""
    for (owner, attr), wrap in wrappers.items():
        setattr(owner, attr, wrap(getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr in wrappers:
            delattr(owner, attr)


@contextmanager
def _memory_trace(learner, device):
    """Events at each half-layer's boundaries during the block, in order: its forward's end ("forward"), the
    backward reaching its output ("backward": the half's own backward starts), and its recompute's start inside
    that backward ("recompute"). On the GPU each event has the memory allocated then and the peak since the event
    before it (the allocator's peak is reset at each): where a long row's memory goes, half by half."""
    import torch

    events = []
    cuda = device.type == "cuda"

    def mark(event: str, layer: int, half: str) -> None:
        row = {"event": event, "layer": layer, "half": half}
        if cuda:
            row.update(allocated_gib=torch.cuda.memory_allocated() / 2**30,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        events.append(row)

    def traced(layer: int, half: str, fn):
        def run(*args):
            if torch._C._current_graph_task_id() != -1:  # a recompute: marked as it starts (the checkpoint stops it
                mark("recompute", layer, half)  # by an exception once it has what the backward needs)
                return fn(*args)
            out = fn(*args)
            mark("forward", layer, half)
            hidden = out[0] if isinstance(out, tuple) else out
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: mark("backward", layer, half))
            return out
        return run

    with _wrapped({(layer, f"{half}_half"): lambda fn, i=layer.layer_idx, half=half: traced(i, half, fn)
                   for layer in learner.module.get_decoder().layers for half in ("mixer", "ffn")}):
        yield events


def _run_layout(layout: str, args, peak_tflops: float, device, meta_rows: list, save) -> None:
    """Every case of one layout; ``save()`` after each, so a run cut short keeps what it measured."""
    import tempfile

    import torch

    from configs.schema import LearnerSection, LossSection, OptimizerSection
    from learner.engine import Learner
    from learner.packing import plan_micro_batches
    from learner.recompute import AutoLayers
    from model.config import MarathonConfig
    from model.memory import checkpointed_layers, learner_memory_bytes
    from model.modeling import MarathonForCausalLM

    overrides = {} if layout == "hybrid" else {"layer_layout": "G"}
    config = MarathonConfig.from_preset(args.preset, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with device:  # initialised where it trains: a 2B-parameter init is minutes on the host's cores
            model = MarathonForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        counts = model.parameter_counts()
        model.save_pretrained(tmp)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = LearnerSection(dtype="bfloat16" if device.type == "cuda" else "float32", gradient_checkpointing=True,
                             micro_batch_tokens=args.micro_batch_tokens,
                             offload_activations_tokens=args.offload_tokens or None,
                             recompute_min_tokens=args.recompute_min_tokens,
                             recompute_layers=args.recompute_layers,
                             compile=args.compile, fused_head=not args.checkpointed_head, zero_stage=args.zero_stage,
                             optimizer=OptimizerSection(flat=not args.deepspeed_step),
                             loss=LossSection(tis_cap=None, ratio_mask=None))  # every model token in the loss
        learner = Learner(tmp, cfg, seed=0)
        print(f"[{layout}] {counts['total'] / 1e9:.2f}B params ({counts['activated'] / 1e9:.2f}B activated), "
              f"built in {time.perf_counter() - t0:.0f}s", flush=True)
    lo, hi = (int(x) for x in args.episode_tokens.split(","))
    cases = [("packed", T, _episodes(T, lo, hi, seed=T)) for T in (int(x) for x in args.tokens.split(",") if x)]
    cases += [("single", T, [T]) for T in (int(x) for x in args.single.split(",") if x and int(x) > 0)]
    warm = _samples(_episodes(min(4096, cases[0][1]), 64, 2048, seed=1), config.vocab_size, seed=1)
    learner.train_rl(warm)  # compiles and autotunes the kernels
    last = None  # (model FLOPs, seconds) of the last case that ran
    non_embedding = counts["activated"] - counts["embeddings"]
    for kind, T, lengths in cases:
        row = {"layout": layout, "case": kind, "tokens": T, "episodes": len(lengths)}
        samples = _samples(lengths, config.vocab_size, seed=T)
        loss_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        flops = model_flops(config, lengths, loss_tokens, non_embedding)
        if last is not None:
            row["predicted_s"] = last[1] * flops / last[0]
            if row["predicted_s"] > args.max_step_s:
                row["skipped"] = f"predicted {row['predicted_s']:.0f}s > --max-step-s {args.max_step_s:.0f}"
                print(json.dumps(row), flush=True)
                meta_rows.append(row)
                save()
                continue
        row_tokens = max(min(T, args.micro_batch_tokens), max(lengths))
        # the peak is a later micro-batch's, beside the earlier ones' gradients, when there are several
        accumulating = len(plan_micro_batches(lengths, args.micro_batch_tokens)) > 1
        choice = learner.recompute_layers  # the learner's own: k, or k(T) under auto (as that micro-batch decides)
        if isinstance(choice, AutoLayers):
            choice.accumulating = accumulating
        layers = choice(row_tokens) if callable(choice) else choice
        recomputed = checkpointed_layers(config.num_hidden_layers, row_tokens, True, args.recompute_min_tokens,
                                         layers)
        row["checkpointed"] = recomputed > 0
        if args.recompute_layers is not None:
            row["recomputed_layers"] = recomputed
        row["offload"] = row["checkpointed"] and bool(args.offload_tokens) and row_tokens >= args.offload_tokens
        predicted = learner_memory_bytes(config, row_tokens, zero_stage=args.zero_stage, checkpointing=True,
                                         offload=row["offload"], recompute_min_tokens=args.recompute_min_tokens,
                                         compiled=args.compile, recompute_layers=layers, accumulating=accumulating)
        row["predicted_peak_gib"] = predicted["total"] / 2**30
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            with _memory_trace(learner, device) if args.memory_trace else nullcontext() as trace:
                dt, stats = _timed_update(learner, samples, device)
            if device.type == "cuda":  # the trace resets the allocator's peak at each event
                peaks = [torch.cuda.max_memory_allocated() / 2**30] + [e["peak_gib"] for e in trace or []]
                row["peak_gib"] = max(peaks)
            if trace is not None:
                row["memory_trace"] = trace
            if args.repeats > 1 and dt <= args.repeat_max_s:
                # steady state: the first update after empty_cache also pays the allocator's device mallocs
                row["first_seconds"] = dt
                with _phase_times(learner, device) as phases:
                    for _ in range(args.repeats - 1):
                        dt, stats = _timed_update(learner, samples, device)
                row["phases_s"] = {k: v / (args.repeats - 1) for k, v in phases.items()}
        except torch.cuda.OutOfMemoryError as e:
            row["oom"] = str(e).split("\n")[0][:600]
            print(json.dumps(row), flush=True)
            meta_rows.append(row)
            save()
            learner.engine.zero_grad()
            torch.cuda.empty_cache()
            continue
        mbs = learner.micro_batches(samples)  # the update's micro-batches, on the device
        row.update(seconds=dt, tokens_per_s=T / dt, loss_tokens=loss_tokens, model_tflops=flops / dt / 1e12,
                   mfu=flops / dt / 1e12 / peak_tflops, loss=stats["loss"], grad_norm=stats["grad_norm"],
                   micro_batches=len(mbs))
        if row_tokens <= args.layer_times_max_tokens:
            try:
                times = _layer_times(learner.module, mbs[0], device, args.compile, learner.fused_head)
                row["layers"] = times
                again = _recomputed_counts(config, recomputed, learner.fused_head)  # forwards run twice, by type
                row["in_step_estimate_s"] = {
                    k: len(mbs) * (v["count"] * (v["fwd_ms"] + v["bwd_ms"]) + again[k] * v["fwd_ms"]) / 1e3
                    for k, v in times.items()}
            except torch.cuda.OutOfMemoryError as e:
                row["layers"] = {"oom": str(e).split("\n")[0][:600]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del mbs
        print(json.dumps(row), flush=True)
        meta_rows.append(row)
        save()
        last = (flops, dt)
    del learner
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _recomputed_counts(config, k: int, fused_head: bool = False) -> dict[str, int]:
    """Per layer type (as `_layer_times` keys them), how many of the first ``k`` decoder layers (the checkpointed
    ones) are of it; the checkpointed head's blocks count once (the fused head recomputes nothing)."""
    dense = min(k, config.first_k_dense)
    return {**{kind: config.layer_kinds[:k].count(kind) for kind in "LSG"}, "MoE": k - dense, "FFN": dense,
            "head": int(not fused_head)}


def _case(r: dict) -> str:
    return (r["case"] + (f" ({m} micro-batches)" if (m := r.get("micro_batches", 1)) > 1 else "")
            + (" (offload)" if r.get("offload") else "")
            + (" (no recompute)" if r.get("checkpointed") is False else "")
            + (f" ({n} layer{'s' * (n > 1)} recomputed)" if r.get("checkpointed") and (n := r.get("recomputed_layers"))
               else ""))


def _markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# `marathon bench learner` ({meta['device']})", "",
             f"Command: `{meta['command']}`", "",
             f"Preset `{meta['preset']}`: {preset_note(meta['preset'])}. bf16 matmul peak measured in the "
             f"same run: {meta['peak_tflops']:.0f} TFLOP/s. One row = one `Learner.train_rl` call (GRPO, one "
             "optimizer step, gradient checkpointing"
             + ("" if (k := meta.get("recompute_layers")) is None else " of as few decoder layers as fit in memory"
                if k == "auto" else f" of the first {k} decoder layer(s)")
             + (f" of rows of at least {n} tokens" if (n := meta.get("recompute_min_tokens")) else "")
             + (", token-local modules compiled" if meta.get("compile") else "")
             + (", head gradients in its forward" if meta.get("fused_head") else "")
             + (f", ZeRO-{z}" if (z := meta.get("zero_stage")) else "")
             + (", DeepSpeed's per-parameter bf16 step" if meta.get("deepspeed_step") else "") + ").", "",
             "| layout | case | tokens | episodes | s | tok/s | TFLOP/s | MFU | peak GiB | predicted GiB | first s | "
             "collate / decoder fwd / bwd / opt step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:
            why = r.get("oom") and "OOM" or r.get("skipped", "")
            lines.append(f"| {r['layout']} | {_case(r)} | {r['tokens']} | {r['episodes']} | {why} | | | | | "
                         f"{r.get('predicted_peak_gib', float('nan')):.1f} | | |")
            continue
        ph = r.get("phases_s")
        phases = " / ".join(f"{ph[k]:.2f}" for k in ("collate", "forward", "backward", "step") if k in ph) if ph else ""
        lines.append(f"| {r['layout']} | {_case(r)} | {r['tokens']} | {r['episodes']} | {r['seconds']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | {100 * r['mfu']:.1f}% | "
                     f"{r.get('peak_gib', float('nan')):.1f} | {r['predicted_peak_gib']:.1f} | "
                     f"{r.get('first_seconds', float('nan')):.2f} | {phases} |")
    lines += ["", "Time per layer type (isolated layer, fwd / bwd ms on the case's first micro-batch; in-step "
              "estimate = micro-batches x count x (2 fwd + bwd), (fwd + bwd) on a row or layer not "
              "checkpointed):", "",
              "| layout | case | tokens | " + " | ".join(["L", "S", "G", "MoE", "FFN", "head"]) + " | step s |",
              "|---|---|---|" + "---|" * 7]
    for r in rows:
        if not isinstance(r.get("layers"), dict) or "oom" in r["layers"]:
            continue
        cells = []
        for k in ["L", "S", "G", "MoE", "FFN", "head"]:
            v = r["layers"].get(k)
            cells.append(f"{v['fwd_ms']:.1f} / {v['bwd_ms']:.1f} ({r['in_step_estimate_s'][k]:.2f} s)" if v else "")
        lines.append(f"| {r['layout']} | {_case(r)} | {r['tokens']} | " + " | ".join(cells) + f" | {r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("marathon bench learner: no CUDA GPU here; run it on the GPU machine or pass --device cpu "
              "--preset tiny", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        from marathon.commands.bench_kernels import _ceilings

        peak = _ceilings()["bf16_matmul_tflops"]
        name = torch.cuda.get_device_name()
    else:
        peak, name = float("nan"), "cpu"
    meta = {"device": name, "torch": torch.__version__, "preset": args.preset, "compile": args.compile,
            "fused_head": not args.checkpointed_head, "zero_stage": args.zero_stage,
            "deepspeed_step": args.deepspeed_step, "recompute_min_tokens": args.recompute_min_tokens,
            "recompute_layers": args.recompute_layers,
            "peak_tflops": peak,
            "command": "marathon bench learner " + " ".join(shlex.quote(a) for a in sys.argv[1:]
                                                             if a not in ("bench", "learner"))}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []

    def save():
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "results.md").write_text(_markdown(meta, rows))

    for layout in args.layouts.split(","):
        _run_layout(layout, args, peak, device, rows, save)
        save()
    print(_markdown(meta, rows))
    return 0 if any("seconds" in r for r in rows) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="marathon bench learner")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
