"""Tiny CPU ablation of the model's switches on an in-context recall task: attention residuals on/off,
bounded vs softplus decay, quantile balancing mode. Each variant trains the same number of AdamW steps from
the same seed on sequences [a_1..a_n, SEP, a_1..a_n]; the loss is measured on the recalled half.

Run: `.venv/bin/python benchmarks/model/ablation.py [--steps 300]` -> prints a table (results in results.md)."""

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from model import MarathonConfig, MarathonForCausalLM  # noqa: E402

VARIANTS = {
    "default (attn residual, bounded, quantile)": {},
    "no attn residual": {"attn_residual": False},
    "softplus decay": {"linear_gate_fn": "softplus"},
    "bias balancing": {"router_balance_mode": "bias"},
    "no balancing": {"router_balance_mode": "none"},
}


def batch(g: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randint(10, 512, (b, n), generator=g)
    ids = torch.cat([a, torch.full((b, 1), 3), a], dim=1)  # 3 = a separator id
    labels = ids.clone()
    labels[:, : n + 1] = -100  # score only the recalled half
    return ids, labels


def run(overrides: dict, steps: int, n: int, seed: int) -> tuple[float, float, float]:
    torch.manual_seed(seed)
    model = MarathonForCausalLM(MarathonConfig.from_preset("tiny", **overrides)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    t = time.time()
    for _ in range(steps):
        ids, labels = batch(g, 16, n)
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    ids, labels = batch(torch.Generator().manual_seed(1), 64, n)
    with torch.no_grad():
        eval_loss = model(ids, labels=labels).loss.item()
    stats = model.train().router_stats()
    max_over_mean = sum(s["max_over_mean"] for s in stats.values()) / len(stats)
    return eval_loss, max_over_mean, time.time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--length", type=int, default=16, help="tokens to recall")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated variant-name prefixes to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"seed {args.seed}, {args.steps} steps\n| variant | eval loss (recalled half) | expert load max/mean | s |\n|---|---|---|---|")
    only = [p for p in args.only.split(",") if p]
    for name, overrides in VARIANTS.items():
        if only and not any(name.startswith(p) for p in only):
            continue
        loss, mom, secs = run(overrides, args.steps, args.length, args.seed)
        print(f"| {name} | {loss:.3f} | {mom:.2f} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
