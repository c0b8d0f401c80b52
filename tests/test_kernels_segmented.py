"""kernels/gated_delta_segmented.py: the gated delta rule run segment by segment (carried states, recomputed
backward) equals the unsegmented run, outputs, final states and every gradient, on packed rows whose sequences
cross the cuts, start on them and end inside them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.chunked_gated_delta import chunk_gated_delta_rule
from kernels.gated_delta_segmented import segmented_gated_delta_rule


def chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, gate_lower_bound=None,
            cu_seqlens=None):
    """The PyTorch chunked path with the Triton wrapper's signature (gate logits when gate_lower_bound is set)."""
    if gate_lower_bound is not None:
        g = gate_lower_bound * torch.sigmoid(g)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


@pytest.mark.parametrize("lengths, seg", [([300], 128), ([100, 28, 200, 1, 71], 128), ([128, 128, 64], 128)])
def test_segmented_equals_whole_row(lengths, seg, one_thread):
    torch.manual_seed(0)
    T, H, K, V = sum(lengths), 2, 16, 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, dtype=torch.float64)
    raw = 2 * torch.randn(1, T, H, K, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(1, T, H, dtype=torch.float64))
    h0 = torch.randn(len(lengths), H, K, V, dtype=torch.float64)
    do, dht = torch.randn_like(v), torch.randn_like(h0)

    def run(segmented):
        xs = [x.clone().requires_grad_() for x in (q, k, v, raw, beta, h0)]
        kw = dict(initial_state=xs[5], output_final_state=True, gate_lower_bound=-5.0, cu_seqlens=cu)
        if segmented:
            o, ht = segmented_gated_delta_rule(chunked, *xs[:5], seg_tokens=seg, **kw)
        else:
            o, ht = chunked(*xs[:5], **kw)
        return [o, ht, *torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)]

    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"], run(True), run(False)):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), name
