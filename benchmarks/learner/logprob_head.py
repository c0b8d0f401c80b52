"""Peak memory and time of the learner's logprob head: the plain path (full [T, vocab] logits, fp32 log-softmax)
against the token-chunked heads of learner/logprobs.py, checkpointed (``head_logprobs``) and fused (gradients
computed in the forward: ``fused_head_loss``, the learner's default), forward + backward of the sum of the
logprobs, each case in its own process.

CPU: peak resident memory above the process's baseline (``ru_maxrss``); CUDA: ``max_memory_allocated``.

    .venv/bin/python benchmarks/learner/logprob_head.py --tokens 2048,4096,8192 --chunked-tokens 65536
    python3 benchmarks/learner/logprob_head.py --device cuda --tokens 16384,65536 --hidden 2048   # GPU

Writes ``logprob_head.json`` / ``logprob_head.md`` beside this file (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASE = r"""
import json, resource, sys, time
import torch
from learner.logprobs import fused_head_loss, head_logprobs

mode, T, V, D, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
head = torch.nn.Linear(D, V, bias=False).to(device)
hidden = (torch.randn(T, D, device=device) * 0.5).requires_grad_()
targets = torch.randint(0, V, (T,), device=device)
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
if mode == "plain":
    loss = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None])[:, 0].sum()
elif mode == "chunked":
    loss = head_logprobs(head, hidden, targets).sum()
else:
    loss = fused_head_loss(head, hidden, targets, torch.arange(T, device=device), lambda lp, rows: lp)[0]
loss.backward()
if device == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({"mode": mode, "tokens": T, "vocab": V, "hidden": D, "device": device, "peak_bytes": peak,
                  "seconds": time.perf_counter() - t0}))
"""


def run_case(mode: str, tokens: int, vocab: int, hidden: int, device: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CASE, mode, str(tokens), str(vocab), str(hidden), device],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                                       "OMP_NUM_THREADS": "2"})
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode} (killed: out of memory?)"]
        return {"mode": mode, "tokens": tokens, "vocab": vocab, "hidden": hidden, "device": device, "error": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,4096,8192", help="scored positions, both paths")
    p.add_argument("--chunked-tokens", default="65536", help="extra lengths for the chunked head only")
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(Path(__file__).parent))
    args = p.parse_args()
    rows = []
    for T in (int(x) for x in args.tokens.split(",") if x):
        for mode in ("plain", "chunked", "fused"):
            rows.append(run_case(mode, T, args.vocab, args.hidden, args.device))
            print(json.dumps(rows[-1]), flush=True)
    for T in (int(x) for x in args.chunked_tokens.split(",") if x):
        for mode in ("chunked", "fused"):
            rows.append(run_case(mode, T, args.vocab, args.hidden, args.device))
            print(json.dumps(rows[-1]), flush=True)
    command = "python3 benchmarks/learner/logprob_head.py " + " ".join(sys.argv[1:])
    lines = [f"# Logprob head peak memory and time ({args.device}, vocab {args.vocab}, hidden {args.hidden}, fp32)",
             "", f"Command: `{command}`", "",
             "| tokens | plain GiB | chunked GiB | fused GiB | plain / fused | plain s | chunked s | fused s |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["tokens"]): r for r in rows}
    for T in sorted({r["tokens"] for r in rows}):
        pl, ch, fu = (by.get((m, T), {}) for m in ("plain", "chunked", "fused"))
        gib = lambda r: f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else r.get("error", "not run")[:60]  # noqa: E731
        sec = lambda r: f"{r['seconds']:.2f}" if "seconds" in r else ""  # noqa: E731
        ratio = f"{pl['peak_bytes'] / fu['peak_bytes']:.1f}x" if "peak_bytes" in pl and "peak_bytes" in fu else ""
        lines.append(f"| {T} | {gib(pl)} | {gib(ch)} | {gib(fu)} | {ratio} | {sec(pl)} | {sec(ch)} | {sec(fu)} |")
    out = Path(args.out)
    (out / "logprob_head.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    (out / "logprob_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
