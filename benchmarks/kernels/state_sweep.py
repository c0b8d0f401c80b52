"""Launch-config sweep of the two sequential state kernels: one config (BV, warps, stages) for both, each in
its own process (a bad config can leave the CUDA context unusable), timing our fwd and fwd+bwd and comparing
outputs and gradients with the first config's (saved to /tmp/state_base.pt by the first run).

    for c in "16 4 2" "16 4 3" "32 4 3"; do timeout 60 python3 benchmarks/kernels/state_sweep.py $c 65536; done
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kernels.gated_delta_triton as gdt  # noqa: E402
from marathon.commands.bench_kernels import _inputs  # noqa: E402

BASE = "/tmp/state_base.pt"


def main(bv: int, nw: int, ns: int, T: int) -> None:
    for kern in (gdt._state_fwd_kernel, gdt._state_bwd_kernel):
        kern.configs = [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)]
    q, k, v, raw, beta = [t.requires_grad_() for t in _inputs(1, T, 16, 128, torch.bfloat16)]
    do = torch.randn(v.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(v.dtype)

    def fwd():
        with torch.no_grad():
            return gdt.chunk_gated_delta_rule_triton(q, k, v, raw, beta, gate_lower_bound=-5.0)[0]

    def step():
        o = gdt.chunk_gated_delta_rule_triton(q, k, v, raw, beta, gate_lower_bound=-5.0)[0]
        return [o.detach(), *torch.autograd.grad(o, (q, k, v, raw, beta), do)]

    out = step()
    if not os.path.exists(BASE):
        torch.save(out, BASE)
    ref = torch.load(BASE)
    diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))
    print(json.dumps({"BV": bv, "nw": nw, "ns": ns, "T": T,
                      "fwd_ms": triton.testing.do_bench(fwd, warmup=10, rep=100, return_mode="median"),
                      "fwd_bwd_ms": triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median"),
                      "max_rel_diff_vs_first": diff}), flush=True)


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5]))
