"""Span transitions of the gated delta rule: the maths of context parallelism (state passing).

The recurrence (``kernels/gated_delta.py``) is affine in the state. Per token, with ``S`` [K, V] per head,

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,        A_t = (I - beta_t k_t k_t^T) diag(exp g_t)     [K, K]

so a span of tokens t = 1..T maps its entering state ``S_0`` to

    S_T = M S_0 + h_ext,        M = A_T ... A_1   (the span's transition, fp32),
    o_t = o_t^0 + (scale P_t^T q_t)^T S_0,        P_t = A_t ... A_1,

where ``h_ext`` / ``o^0`` are the final state / outputs of the span run from a zero state. A sequence start
inside the span resets the state, so every token from it on sees nothing of ``S_0`` (``M = 0`` when the span's
last sequence starts inside it).

Context parallelism cuts a packed row into contiguous shards, one per rank. Each rank runs its shard from a
zero state, forms ``(M_r, h_ext_r)``, and after ONE all-gather of those (a few [K, K + V] matrices per head, not
the sequence) folds the state entering its shard, ``h_r = M_{r-1} (... (M_0 h_0 + h_ext_0) ...) + h_ext_{r-1}``,
then adds the incoming state's contribution to its outputs. This is flash-linear-attention's context-parallel
state passing (``fla/ops/cp``) and LASP-2 (arXiv 2502.07563): one all-gather of per-shard states instead of a
ring over the sequence; prime-rl PR #2080 does the same for Gated DeltaNet.

How the pieces are computed here (`shard_pass`): ONE run of the ordinary chunked kernel on *augmented* values.
Feed values ``[0_K | v]`` (width K + V) and the initial state ``[I_K | 0]``. The recurrence acts column by
column, so the first K columns of the state evolve as ``P_t`` (no value is written into them) and the last V as
the zero-start state: the final state is ``[M | h_ext]`` and the outputs are ``[scale P_t^T q_t | o_t^0]``,
i.e. the effective queries that carry the incoming state into the outputs, and the zero-state outputs. That is
the chunked form of the transition for free: inside the kernel each 64-token chunk applies
``diag(exp G_C) - (k exp(G_C - G))^T W`` (its WY factor ``W``, see ``kernels/chunked_gated_delta.py``) to the
first K columns, and the fast paths (Triton on CUDA, which takes K + V = 128 or 256) run it unchanged.
The correction ``o += q_eff h_in`` is then one [T, K] x [K, V] product per head in PyTorch, so the gradient with
respect to the incoming state (and through it to earlier ranks' ``M`` and ``h_ext``) is plain autograd; the
kernel itself needs no gradient for its (constant) initial state. Cost versus a second kernel run with
``initial_state``: the K-only work (decay cumsums, the pair matrices, the triangular solve) is done once, only
the value-width work doubles (K = V), and only for the shard's first sequence when it continues from the
previous rank.

`transition_reference` is the token-by-token product, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def transition_reference(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """M = A_T ... A_1 with A_t = (I - beta_t k_t k_t^T) diag(exp g_t), token by token.

    k, g: [B, T, H, K]; beta: [B, T, H] -> M [B, H, K, K] in fp32 (fp64 for fp64 inputs)."""
    B, T, H, K = k.shape
    acc = torch.promote_types(k.dtype, torch.float32)
    k, g, beta = k.to(acc), g.to(acc), beta.to(acc)
    M = torch.eye(K, dtype=acc, device=k.device).expand(B, H, K, K).clone()
    for t in range(T):
        M = M * g[:, t].exp().unsqueeze(-1)  # diag(exp g_t) M
        kt = k[:, t]  # [B, H, K]
        M = M - beta[:, t, :, None, None] * kt.unsqueeze(-1) * torch.einsum("bhk,bhkj->bhj", kt, M).unsqueeze(-2)
    return M


@dataclass
class ShardPass:
    """What one rank's zero-state run of its shard gives (`shard_pass`)."""

    o: torch.Tensor  # [1, T, H, V] outputs from a zero incoming state
    q_eff: torch.Tensor | None  # [1, first_len, H, K] scale * P_t^T q_t of the first sequence, or None (no carry)
    M: torch.Tensor  # [1, H, K, K] fp32: transition from the shard start to its end (0 after a reset)
    h_ext: torch.Tensor  # [1, H, K, V] fp32: the shard's final state from a zero incoming state


def shard_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    carries: bool,
    **kernel_kwargs,
) -> ShardPass:
    """Run one shard of a packed row (B = 1) from a zero incoming state.

    ``kernel_kwargs`` go to ``kernels.gated_delta_rule`` (e.g. ``bounded_gate``). ``cu_seqlens`` [m + 1]:
    the sequences inside the shard (local offsets, 0 .. T). ``carries``: the shard's first sequence began on an
    earlier rank, so the incoming state reaches its tokens (a shard starting with a new sequence ignores it).

    The first sequence runs on augmented values when it carries (module docstring); the others run as usual.
    """
    from kernels import gated_delta_rule  # the package entry: the fastest path for the inputs

    B, T, H, K = q.shape
    V = v.shape[-1]
    bounds = cu_seqlens.tolist()
    first = bounds[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # the kernel's state dtype
    zero_M = q.new_zeros(B, H, K, K, dtype=acc)
    if not carries:
        o, finals = gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens, **kernel_kwargs)
        return ShardPass(o, None, zero_M, finals[-1:])
    head = slice(0, first)
    v_aug = torch.cat([v.new_zeros(B, first, H, K), v[:, head]], dim=-1)  # [1, first, H, K + V]
    eye = torch.eye(K, dtype=acc, device=q.device).expand(B, H, K, K)
    h0 = torch.cat([eye, q.new_zeros(B, H, K, V, dtype=acc)], dim=-1)  # [I | 0]
    o_aug, X = gated_delta_rule(
        q[:, head], k[:, head], v_aug, g[:, head], beta[:, head], initial_state=h0, output_final_state=True,
        **kernel_kwargs,
    )
    q_eff, o = o_aug.split([K, V], dim=-1)
    if first == T:
        return ShardPass(o, q_eff, X[..., :K], X[..., K:])
    tail = slice(first, T)
    o_rest, finals = gated_delta_rule(
        q[:, tail], k[:, tail], v[:, tail], g[:, tail], beta[:, tail], output_final_state=True,
        cu_seqlens=cu_seqlens[1:] - first, **kernel_kwargs,
    )
    return ShardPass(torch.cat([o, o_rest], dim=1), q_eff, zero_M, finals[-1:])


def fold_incoming(M: torch.Tensor, h_ext: torch.Tensor, rank: int, h0: torch.Tensor | None = None) -> torch.Tensor:
    """The state entering shard ``rank``: h_{j+1} = M_j h_j + h_ext_j from h_0 (zero when None).

    M [R, H, K, K], h_ext [R, H, K, V] (every rank's, in rank order) -> [H, K, V] in fp32 (fp64 for fp64
    states). Differentiable in all of them, so the incoming state's gradient reaches the earlier ranks'
    transitions and final states."""
    acc = torch.promote_types(h_ext.dtype, torch.float32)
    h = h_ext.new_zeros(h_ext.shape[1:], dtype=acc) if h0 is None else h0.to(acc)
    for j in range(rank):
        h = M[j].to(acc) @ h + h_ext[j].to(acc)
    return h


def add_incoming(o: torch.Tensor, q_eff: torch.Tensor | None, h_in: torch.Tensor) -> torch.Tensor:
    """o [1, T, H, V] plus the incoming state's share on the first sequence: o_t += q_eff_t^T h_in (fp32)."""
    if q_eff is None:
        return o
    n = q_eff.shape[1]
    acc = torch.promote_types(h_in.dtype, torch.float32)
    head = (o[:, :n].to(acc) + torch.einsum("bthk,hkv->bthv", q_eff.to(acc), h_in.to(acc))).to(o.dtype)
    return torch.cat([head, o[:, n:]], dim=1)
