"""Learner memory on CPU against episode length: one forward + backward of the ``tiny`` preset on a single
episode of T tokens, gradient checkpointing on, in fp32.

What runs is the learner's own path: the packed micro-batch of one episode (``learner.packing.collate``, so
``cu_seqlens`` = [0, T] and per-segment ``position_ids``), the decoder (``MarathonForCausalLM.get_decoder()``,
training mode, gradient checkpointing), then the learner's token-chunked logprob head
(``learner.logprobs.head_logprobs``: no [T, vocab] logits) over every position; the loss is the sum of the
logprobs. Each length runs in a fresh process; memory is that process's peak resident set during the step
(VmHWM after resetting it just before the step) and its growth over the RSS held before the step (weights,
the interpreter, torch). Time is the step's wall time.

    python benchmarks/learner/cpu_memory.py                   # 8K, 16K, 32K; writes cpu_memory.md / .json
    python benchmarks/learner/cpu_memory.py --lengths 4096,8192 --malloc mmap --no-write
    python benchmarks/learner/cpu_memory.py --lengths 32768 --malloc mmap --no-write --token-chunk 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(length: int, threads: int | None = None, preset: str = "tiny", token_chunk: int | None = None) -> dict:
    """One forward + backward at ``length`` tokens in THIS process: {tokens, seconds, rss_before_mib,
    peak_rss_mib, growth_mib}. Call it in a fresh process (the peak is the process's). ``token_chunk``: the
    layers' token chunk (``model.chunking.TOKEN_CHUNK``; None: its default)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from learner.logprobs import head_logprobs
    from learner.packing import Sample, collate
    from model import MarathonConfig, MarathonForCausalLM, chunking

    if threads:
        torch.set_num_threads(threads)
    if token_chunk:
        chunking.TOKEN_CHUNK = token_chunk
    torch.manual_seed(0)
    model = MarathonForCausalLM(MarathonConfig.from_preset(preset)).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(1, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    mb = collate([Sample(token_ids=ids.tolist(), loss_mask=[1] * length, logprobs=[0.0] * length)], [0], packed=True)

    def step():
        hidden = model.get_decoder()(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                     cu_seqlens=mb.cu_seqlens, use_cache=False).last_hidden_state
        logp = head_logprobs(model.get_output_embeddings(), hidden[0], mb.targets[0])
        logp.sum().backward()

    step_small = collate([Sample(token_ids=ids[:256].tolist(), loss_mask=[1] * 256, logprobs=[0.0] * 256)], [0],
                         packed=True)
    hidden = model.get_decoder()(input_ids=step_small.input_ids, cu_seqlens=step_small.cu_seqlens).last_hidden_state
    hidden.sum().backward()  # warm-up: lazy inits, allocator pools
    model.zero_grad(set_to_none=False)  # gradients exist before the step: their memory is not growth
    rss_before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak resident set) to the current RSS
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"tokens": length, "seconds": round(seconds, 2), "rss_before_mib": round(rss_before / 1024, 1),
            "peak_rss_mib": round(peak / 1024, 1), "growth_mib": round((peak - rss_before) / 1024, 1)}


MMAP_THRESHOLD = 1 << 17  # bytes: glibc's initial threshold, fixed (MALLOC_MMAP_THRESHOLD_)


def measure_in_subprocess(length: int, threads: int | None = None, preset: str = "tiny", timeout: float = 1200,
                          malloc: str = "mmap", token_chunk: int | None = None) -> dict:
    """``measure`` in a fresh Python process (its own peak resident set). ``malloc``: "mmap" fixes glibc's mmap
    threshold at 128 KiB (MALLOC_MMAP_THRESHOLD_), so every freed tensor goes back to the OS and the resident
    set follows the live tensors; "default" leaves glibc's dynamic threshold, which moves up to 32 MiB after
    the first large free and then serves tensors from the heap, whose freed holes stay resident."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.learner.cpu_memory import measure; "
            f"print('RESULT', json.dumps(measure({length}, {threads!r}, {preset!r}, {token_chunk!r})))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    elif malloc != "default":
        raise ValueError(f"malloc must be 'mmap' or 'default', got {malloc!r}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"measure({length}) failed:\n{out.stderr[-4000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: the 2 shared cores)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--malloc", default="mmap,default", help="glibc settings to run: mmap, default or both")
    ap.add_argument("--no-write", action="store_true", help="print only; do not rewrite cpu_memory.{md,json}")
    ap.add_argument("--token-chunk", type=int, default=None,
                    help="the layers' token chunk (model.chunking.TOKEN_CHUNK, default 65536: shorter rows unchunked)")
    args = ap.parse_args()
    rows = []
    for malloc in args.malloc.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            row = {"malloc": malloc, **measure_in_subprocess(length, args.threads, args.preset, malloc=malloc,
                                                                 token_chunk=args.token_chunk)}
            rows.append(row)
            print(f"malloc={malloc:7s} {row['tokens']:>7} tokens  {row['seconds']:8.2f} s  peak RSS "
                  f"{row['peak_rss_mib']:8.1f} MiB  growth {row['growth_mib']:8.1f} MiB  "
                  f"({1024 * row['growth_mib'] / row['tokens']:.1f} KiB/token)", flush=True)
    if args.no_write:
        return
    import torch

    defaults = {"lengths": "8192,16384,32768", "threads": 1, "preset": "tiny", "malloc": "mmap,default",
                "token_chunk": None}
    cmd = "python benchmarks/learner/cpu_memory.py" + "".join(
        f" --{k.replace('_', '-')} {getattr(args, k)}" for k in defaults if getattr(args, k) != defaults[k])
    meta = {"command": cmd, "torch": torch.__version__, "threads": args.threads, "cpus": os.cpu_count(),
            "preset": args.preset, "load_average": os.getloadavg()}
    (OUT / "cpu_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Learner memory on CPU against episode length",
        "",
        f"`{cmd}` (torch {meta['torch']}, {args.threads} intra-op thread(s), {meta['cpus']} CPUs). One forward + "
        f"backward of the `{args.preset}` preset (fp32) on one packed episode of T tokens, gradient checkpointing on: "
        "the decoder (`MarathonForCausalLM.get_decoder()`) and the learner's token-chunked logprob head "
        "(`learner.logprobs.head_logprobs`, no [T, vocab] logits) over every position, loss = sum of logprobs. "
        "Each length in a fresh process. Peak RSS: the process's peak resident set during the step; growth: "
        "that peak minus the RSS before the step (weights, gradients, interpreter).",
        "",
        "malloc `mmap`: glibc's mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_=131072`), so freed tensors "
        "go back to the OS and the resident set follows the live tensors. malloc `default`: glibc's dynamic "
        "threshold, which rises to 32 MiB after the first large free; tensors below it then come from the heap, "
        "whose freed holes stay resident (allocator retention, not live memory).",
        "",
        "| malloc | tokens | time (s) | peak RSS (MiB) | growth (MiB) | growth per token (KiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['malloc']} | {r['tokens']} | {r['seconds']} | {r['peak_rss_mib']} | {r['growth_mib']} | "
                     f"{1024 * r['growth_mib'] / r['tokens']:.1f} |")
    lines += ["", f"Machine load average while measuring (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in meta['load_average'])}"
              " on the shared 2-core machine: times are indicative only.",
              "", "Before (issue 12, dense [T, T] sliding-window masks): 1.75 GB at 8K, 13.7 GB and 145 s at 32K."]
    (OUT / "cpu_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
