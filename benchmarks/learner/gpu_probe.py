"""Where the learner's memory and time go on the GPU, one part of the model at a time (DeepSpeed only in ``step``).

    memory   peak device memory of each half-layer of a preset (the KDA, sliding and MLA mixers with their
             attention-residual mix; the MoE) on one episode of T tokens: in a no-grad forward, and in a forward +
             backward (what gradient checkpointing's recompute + backward holds for that half), above its inputs
    head     the logprob head (`learner.logprobs.head_logprobs`): forward and backward time and peak memory per
             chunk size, and the profiler's top kernels of one backward
    moe      the MoE half's forward + backward time with each grouped GEMM (`kernels.GROUPED_MM_CUDA`)
    profile  one forward + backward of the decoder and the head on a packed row (gradient checkpointing on):
             the profiler's top kernels by device time
    layers   one layer of each kind (KDA / sliding / MLA mixer, MoE, dense FFN) on a packed row, its token-local
             parts compiled as ``learner.compile`` runs them (``--eager``: not): forward and backward ms and the
             profiler's top kernels of one forward + backward, per kind
    step     the learner's optimizer step alone (``engine.step()`` of its DeepSpeed bf16 engine: gradient norm,
             clipping, AdamW on the fp32 master weights, the bf16 copy back) at each ZeRO stage of
             ``--zero-stages``, wall and device ms with its top kernels and memory, beside one fused AdamW step
             over a flat fp32 tensor of as many parameters (the floor)

    python3 benchmarks/learner/gpu_probe.py memory head moe profile --out $OUT/probe
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from marathon.commands.bench_learner import _sync  # noqa: E402

GiB = 2**30


def _model(preset: str, device: torch.device):
    from model.config import MarathonConfig
    from model.modeling import MarathonForCausalLM

    torch.manual_seed(0)
    with device:
        model = MarathonForCausalLM(MarathonConfig.from_preset(preset))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(dtype).train()


def _ctx(T: int, device: torch.device, lengths: list[int] | None = None):
    """The per-forward context of a packed row of ``lengths`` (one episode of T tokens by default)."""
    from model.modeling import _Context

    lengths = lengths or [T]
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), cu.diff())
    pos = torch.arange(T, device=device) - cu[seg]
    return _Context(pos[None], None, cu, pos, None, forward_id=0)


def _peak_above(device: torch.device, fn) -> float:
    """GiB allocated at the peak of ``fn()`` above what was allocated before it (CUDA; NaN elsewhere)."""
    if device.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def _discard_routing(layer) -> None:
    for m in layer.modules():
        if hasattr(m, "discard_pending"):
            m.discard_pending()


def probe_memory(model, device, lengths: list[int], mla_lengths: list[int], segments: list[int]) -> list[dict]:
    """Per half-layer peaks. The layers are the last block's (a partial block and every completed block as
    inputs, as the model runs them); the MoE is the first KDA layer's FFN half there."""
    import kernels

    inner, cfg = model.get_decoder(), model.config
    kinds = cfg.layer_kinds
    last = {k: max(i for i, x in enumerate(kinds) if x == k) for k in set(kinds)}
    n_blocks = -(-len(kinds) // cfg.attn_residual_block_size) if cfg.attn_residual else 0
    rows = []
    cases = [("L", "mixer", seg) for seg in segments] + [("S", "mixer", None), ("G", "mixer", None)]
    cases.append(("L", "ffn", None))
    for kind, half, seg in cases:
        if kind not in last:
            continue
        layer = inner.layers[last[kind]]
        for T in (mla_lengths if kind == "G" and half == "mixer" else lengths):
            row = {"kind": "MoE" if half == "ffn" and layer.is_moe else kind, "half": half, "tokens": T}
            if seg is not None:
                row["kda_segment"] = seg
                kernels.SEGMENT_TOKENS = seg
            ctx = _ctx(T, device)
            D = cfg.hidden_size
            try:
                inputs = [torch.randn(1, T, D, device=device, dtype=next(model.parameters()).dtype) * 0.5
                          for _ in range(max(n_blocks, 1))]  # the partial block, then the completed ones

                def run(*xs):
                    hidden, blocks = xs[0], (list(xs[1:]) if n_blocks else None)
                    if half == "mixer":
                        return layer.mixer_half(hidden, blocks, ctx)
                    return layer.ffn_half(hidden, blocks, None, ctx.forward_id)[0]

                def forward():
                    with torch.no_grad():
                        run(*inputs)

                t0 = time.perf_counter()
                row["forward_gib"] = _peak_above(device, forward)
                xs = [x.requires_grad_() for x in inputs]

                def forward_backward():
                    out = run(*xs)
                    out.backward(torch.randn_like(out))

                row["forward_backward_gib"] = _peak_above(device, forward_backward)
                row["inputs_gib"] = len(inputs) * T * D * inputs[0].element_size() / GiB
                row["seconds"] = time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError as e:
                row["oom"] = str(e).split("\n")[0][:300]
            finally:
                inputs = xs = None
                model.zero_grad(set_to_none=True)
                _discard_routing(layer)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    kernels.SEGMENT_TOKENS = 1 << 18
    return rows


def _timed(device, fn, repeats: int = 3) -> float:
    """Median ms of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _device_events(prof) -> list:
    """The profile's device-side events (not the CPU ops that launched them, when the profile records CPU too)."""
    cpu = torch.autograd.DeviceType.CPU
    return [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type != cpu]


def _top_kernels(prof, n: int = 25) -> list[dict]:
    events = _device_events(prof)
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) or 1.0
    return [{"name": e.key[:300], "calls": e.count, "device_ms": e.self_device_time_total / 1e3,
             "share": e.self_device_time_total / total} for e in events[:n]]


def _top_ops(prof, n: int = 15) -> list[dict]:
    """The PyTorch ops that launched the most device time themselves, with their input shapes: eager ops, and the
    extern and fallback kernels a compiled graph calls (Inductor's own Triton kernels and ours are not under one)."""
    events = [e for e in prof.key_averages(group_by_input_shape=True)
              if e.key.startswith("aten::") and e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return [{"op": e.key, "calls": e.count, "device_ms": e.self_device_time_total / 1e3,
             "shapes": str(e.input_shapes)[:200]} for e in events[:n]]


def probe_head(model, device, rows_n: int, chunks: list[int]) -> dict:
    """The logprob head over ``rows_n`` scored rows, per chunk size."""
    from learner import logprobs

    head, cfg = model.get_output_embeddings(), model.config
    dtype = head.weight.dtype
    h = (torch.randn(rows_n, cfg.hidden_size, device=device, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (rows_n,), device=device)
    out = {"rows": rows_n, "vocab": cfg.vocab_size, "chunks": []}
    for chunk in chunks:
        def fwd():
            return logprobs.head_logprobs(head, h, targets, 1.0, chunk)

        def fwd_bwd():
            fwd().sum().backward()

        fwd_ms = _timed(device, fwd)
        both_ms = _timed(device, fwd_bwd)
        row = {"chunk": chunk, "forward_ms": fwd_ms, "backward_ms": both_ms - fwd_ms,
               "peak_gib": _peak_above(device, fwd_bwd)}
        flops = 6.0 * rows_n * cfg.hidden_size * cfg.vocab_size  # forward + backward matmuls, recompute not counted
        row["tflops"] = flops / both_ms / 1e9
        print(json.dumps(row), flush=True)
        out["chunks"].append(row)
        head.weight.grad = None
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            logprobs.head_logprobs(head, h, targets, 1.0, chunks[0]).sum().backward()
            torch.cuda.synchronize()
        out["top_kernels"] = _top_kernels(prof, 15)
    head.weight.grad = None
    return out


def probe_moe(model, device, T: int) -> list[dict]:
    """The MoE half's forward + backward per grouped GEMM path, on T tokens."""
    import kernels

    layer = next(m for m in model.get_decoder().layers if m.is_moe)
    x = (torch.randn(1, T, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype) * 0.5)
    x.requires_grad_()
    rows = []
    for path in ("triton", "torch"):
        kernels.GROUPED_MM_CUDA = path

        def fwd():
            with torch.no_grad():
                layer.ffn(x, None)

        def fwd_bwd():
            out = layer.ffn(x, None)[0]
            out.backward(torch.ones_like(out))

        try:
            row = {"path": path, "tokens": T, "forward_ms": _timed(device, fwd), "forward_backward_ms": _timed(device, fwd_bwd)}
        except RuntimeError as e:
            row = {"path": path, "tokens": T, "error": str(e).split("\n")[0][:300]}
        _discard_routing(layer)
        model.zero_grad(set_to_none=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    kernels.GROUPED_MM_CUDA = "torch"
    return rows


def probe_profile(model, device, T: int) -> dict:
    """One decoder + head forward + backward of a packed row of T tokens (episodes of 2K-16K), checkpointing on."""
    from learner.logprobs import head_logprobs
    from learner.packing import collate
    from marathon.commands.bench_learner import _episodes, _samples

    model.gradient_checkpointing_enable()
    samples = _samples(_episodes(T, 2048, 16384, seed=T), model.config.vocab_size, seed=T)
    mb = collate(samples, list(range(len(samples))), packed=True)
    keep = (mb.loss_mask != 0).flatten().to(device)

    def step():
        hidden = model.get_decoder()(input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device),
                                     cu_seqlens=mb.cu_seqlens.to(device), use_cache=False).last_hidden_state
        logp = head_logprobs(model.get_output_embeddings(), hidden.flatten(0, 1)[keep],
                             mb.targets.to(device).flatten()[keep])
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    ms = _timed(device, step, repeats=2)
    out = {"tokens": T, "step_ms": ms}
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        out["top_kernels"] = _top_kernels(prof, 40)
    for layer in model.get_decoder().layers:
        _discard_routing(layer)
    model.gradient_checkpointing_disable()
    return out


def probe_step(build, device: torch.device, stages: list[str], repeats: int = 3) -> dict:
    """The learner's optimizer step on the preset (``learner.engine.ds_config``, bf16 on CUDA) at each ZeRO stage
    of ``stages``, each on a fresh model from ``build()`` after a backward of a short row: step wall / device ms,
    launches, top kernels, the states held and the step's peak; against the floor: torch's fused AdamW on one flat
    fp32 tensor of as many parameters. One rank: nothing is sharded, but each stage steps through its own optimizer:
    "0" the learner's ``FlatAdamW`` (``learner/optimizer.py``; in fp32, a bare torch AdamW), "0u" torch's AdamW in
    DeepSpeed's per-parameter FP16_UnfusedOptimizer (``learner.optimizer.flat: false``), "0d" DeepSpeed's own
    FusedAdam in its flat FP16_Optimizer, "1" and "2" DeepSpeed's ZeRO optimizer, "1f" ZeRO-1 with fp32 gradient
    accumulation (DeepSpeed's BF16_Optimizer). An engine's memory is not all freed when it is dropped, so a later
    stage runs beside it: ``run_gpu.sh step-probe`` runs one process per stage."""
    import deepspeed

    from configs.schema import LearnerSection, OptimizerSection
    from learner.dist import init_distributed
    from learner.engine import client_optimizer, ds_config

    init_distributed(1)
    out = {}
    for spec in stages:
        cfg = LearnerSection(dtype="bfloat16" if device.type == "cuda" else "float32",
                             optimizer=OptimizerSection(flat=spec == "0"))
        config = ds_config(cfg, int(spec[0]))
        if "f" in spec:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if "d" in spec:  # DeepSpeed's FusedAdam (its CUDA op, built on first use) instead of torch's AdamW
            for key in ("torch_adam", "fused"):
                config["optimizer"]["params"].pop(key)
        model = build()
        params = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in params)
        t0 = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                               optimizer=client_optimizer(cfg, int(spec[0]), params))
        init_s = time.perf_counter() - t0
        ids = torch.randint(0, model.config.vocab_size, (1, 256), device=device)

        def backward():
            engine.backward(engine(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean())
            _sync(device)

        wall = []
        for _ in range(repeats + 1):  # the first step also builds the optimizer state
            backward()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            wall.append((time.perf_counter() - t0) * 1e3)
        row = {"params": n, "step_ms": statistics.median(wall[1:]), "first_step_ms": wall[0], "init_s": init_s}
        if device.type == "cuda":
            row.update(step_peak_gib=torch.cuda.max_memory_allocated() / GiB,
                       held_after_step_gib=torch.cuda.memory_allocated() / GiB)
            backward()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                engine.step()
                torch.cuda.synchronize()
            # device_ms also counts GPU annotation ranges (Optimizer.step#AdamW.step) over their kernels
            events = [e for e in _device_events(prof) if e.self_device_time_total > 0]
            row.update(device_ms=sum(e.self_device_time_total for e in events) / 1e3,
                       launches=sum(e.count for e in events), top_kernels=_top_kernels(prof, 20))
        row["optimizer"] = type(engine.optimizer).__name__
        print(json.dumps({"zero_stage": spec, **{k: v for k, v in row.items() if k != "top_kernels"}}), flush=True)
        out[f"zero{spec}"] = row
        engine.destroy()
        del engine, model, params
        gc.collect()  # the engine's fp32 master weights, gradients and moments
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flat = torch.zeros(n, dtype=torch.float32, device=device, requires_grad=True)
    flat.grad = torch.randn_like(flat)
    adam = torch.optim.AdamW([flat], lr=1e-6, fused=device.type == "cuda")
    out["floor_fused_adamw_ms"] = _timed(device, adam.step)
    return out


def probe_layers(model, device, T: int, compiled: bool, top: int = 15) -> dict:
    """Per layer kind: fwd / bwd ms (median of 3 after a warm-up) and the top kernels of one fwd + bwd, on a packed
    row of T tokens cut as the learner bench cuts its 64K row (episodes of 2K-16K tokens)."""
    from learner.compile import compile_token_local
    from marathon.commands.bench_learner import _episodes

    lengths = _episodes(T, 2048, 16384, seed=T)
    ctx = _ctx(T, device, lengths)
    if compiled:
        compile_token_local(model)
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, T, model.config.hidden_size, device=device, dtype=dtype) * 0.5
    out = {"tokens": T, "episodes": len(lengths), "compiled": compiled, "kinds": {}}
    for layer in model.get_decoder().layers:
        parts = {layer.kind: lambda h, layer=layer: layer.mix(h, ctx),
                 "MoE" if layer.is_moe else "FFN": lambda h, layer=layer: layer.ffn(h, None)}
        for kind, fn in parts.items():
            if kind in out["kinds"]:
                continue
            h = x.detach().requires_grad_()

            def fwd():
                y = fn(h)
                return y[0] if isinstance(y, tuple) else y

            def fwd_bwd():
                y = fwd()
                y.backward(torch.ones_like(y))

            fwd_ms, both_ms = _timed(device, fwd), _timed(device, fwd_bwd)
            row = {"forward_ms": fwd_ms, "backward_ms": both_ms - fwd_ms}
            model.zero_grad(set_to_none=True)  # the profiled call's gradients are the first (no accumulation)
            if device.type == "cuda":
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
                    fwd_bwd()
                    torch.cuda.synchronize()
                row["top_kernels"] = _top_kernels(prof, top)
                row["top_ops"] = _top_ops(prof, top)
            _discard_routing(layer)
            print(json.dumps({"kind": kind, **row}), flush=True)
            out["kinds"][kind] = row
    if compiled:  # a graph break runs the rest of a method eagerly: there should be none
        from torch._dynamo.utils import counters

        out["graph_breaks"] = {str(k): v for k, v in counters["graph_break"].items()}
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
        print(json.dumps({"graph_breaks": out["graph_breaks"], "unique_graphs": out["unique_graphs"]}), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probes", nargs="+", choices=["memory", "head", "moe", "profile", "layers", "step"])
    ap.add_argument("--preset", default="learner-bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--lengths", default="262144,1048576", help="memory: episode lengths (KDA, sliding, MoE)")
    ap.add_argument("--mla-lengths", default="262144,524288", help="memory: episode lengths for the MLA mixer")
    ap.add_argument("--segments", default="262144,65536", help="memory: KDA kernel segment lengths to compare")
    ap.add_argument("--head-rows", type=int, default=40960)
    ap.add_argument("--head-chunks", default="1024,4096,8192")
    ap.add_argument("--moe-tokens", type=int, default=65536)
    ap.add_argument("--profile-tokens", type=int, default=65536, help="profile, layers: tokens in the packed row")
    ap.add_argument("--eager", action="store_true", help="layers: do not compile the token-local parts")
    ap.add_argument("--zero-stages", default="0",
                    help="step: the optimizers to time (0: the learner's FlatAdamW; 0u: torch's AdamW in "
                         "DeepSpeed's per-parameter bf16 wrapper; 0d: DeepSpeed's FusedAdam; 1, 2: ZeRO-1, 2; 1f: "
                         "ZeRO-1 accumulating fp32 gradients)")
    ap.add_argument("--out", default="benchmarks/learner/probe")
    args = ap.parse_args()
    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    model = _model(args.preset, device)
    results = {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for probe in args.probes:
        print(f"=== {probe}", flush=True)
        t0 = time.perf_counter()
        if probe == "memory":
            results[probe] = probe_memory(model, device, ints(args.lengths), ints(args.mla_lengths), ints(args.segments))
        elif probe == "head":
            results[probe] = probe_head(model, device, args.head_rows, ints(args.head_chunks))
        elif probe == "moe":
            results[probe] = probe_moe(model, device, args.moe_tokens)
        elif probe == "layers":
            results[probe] = probe_layers(model, device, args.profile_tokens, compiled=not args.eager)
        elif probe == "step":  # last, on fresh models: an engine takes its model over
            del model
            results[probe] = probe_step(lambda: _model(args.preset, device), device, args.zero_stages.split(","))
        else:
            results[probe] = probe_profile(model, device, args.profile_tokens)
        print(f"=== {probe}: {time.perf_counter() - t0:.0f}s", flush=True)
        (out_dir / "probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
