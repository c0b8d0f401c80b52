"""Context parallelism for the hybrid model: one packed row split into contiguous shards, one per CP rank.

Applied in one place, as torchtitan applies parallelism: `ContextParallel(model, group)` swaps CP-aware forward
functions into the token mixers of the UNCHANGED model (``model/attention/linear.py``, ``sliding.py``,
``mla.py``; the short convolutions through their ``state`` argument) and `ContextParallel.sharded` cuts a
micro-batch. No process group is threaded through a module; outside a ``sharded`` block the mixers run their
own forward. Every layer type crosses the cut exactly:

- KDA / gated delta rule (L): each rank runs its shard from a zero state, forms the shard's fp32 transition
  ``M`` [K, K] per head and its final state ``h_ext``; ONE all-gather of ``[M | h_ext]``; rank r folds the
  state entering its shard and adds that state's share to the outputs of its first sequence
  (``kernels/transition.py`` has the maths: one kernel run on augmented values gives outputs, effective
  queries, ``M`` and ``h_ext``). State passing as flash-linear-attention's ``fla/ops/cp`` and LASP-2
  (arXiv 2502.07563); prime-rl PR #2080 does it for Gated DeltaNet. No all-gather of the sequence.
- Short convolutions (the L layers' q/k/v) and sliding-window attention (S): a halo of the previous ranks'
  last ``kernel - 1`` / ``window - 1`` tokens (q/k/v projections; rotated keys and values), gathered from as
  many earlier shards as the halo spans (a window may cover several shards).
- Gated MLA (G): an all-gather of the compressed latent (normed ``c_kv`` + the rope key: kv_lora_rank +
  qk_rope_head_dim values per token, far less than per-head K/V); keys/values of the shard's first sequence are
  rebuilt from it locally; the shard's queries attend causally (a sequence carried in from earlier shards in
  query blocks, `_attend_carried`, with no [T, carried + T] mask).
- MoE, norms, block attention residuals, the LM head: token-local, run on the shard as is.

Collectives are autograd Functions: all-gather in the forward, reduce-scatter of the gathered tensor's gradient
in the backward, so every gradient (the incoming state's, the halo's, the latent's) returns to the rank that
owns the tokens. Each gathered tensor is tied into the layer's output (`_Tie`), so every rank runs every
collective's backward, in the reverse order of the forward, whether or not its shard used what it gathered.
Parameter gradients are per-shard partial sums: sum them over the CP group (`all_reduce_gradients`, or fold
the CP ranks into the data-parallel gradient reduction with the loss scaled by the CP size when that
reduction averages); normalise the loss by the whole row's token count (the unsharded ``mb.num_loss_tokens``),
not the shard's.

Shards are equal (all-gathers of equal sizes): a row whose length is not a multiple of the CP size gets a padding
sequence at its end (masked out of the loss; its at most CP - 1 tokens are routed like any other, so they count
in the MoE balancing statistics, as the padding of a padded batch does). Load: causal attention makes later ranks' MLA work larger (no
zigzag reordering: contiguous shards keep the KDA state passing to one all-gather of one state per rank).

Ranks run in separate processes (`DistComm` over a ``torch.distributed`` group: gloo on CPU, NCCL on GPU) or, for
tests and single-device checks, as threads of one process (`simulate`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.transition import add_incoming, fold_incoming, shard_pass

# -- communication -------------------------------------------------------------------------------------------


class DistComm:
    """The collectives CP needs, over a ``torch.distributed`` process group (None: the default group)."""

    connected = False  # gathered tensors are copies: gradients travel through `_AllGather`'s backward

    def __init__(self, group: Any = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """parts[i] from every rank, summed, lands on rank i."""
        out = torch.empty_like(parts[self.rank])
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)


class _Hub:
    """Where simulated ranks (threads) meet: one slot per rank and a barrier."""

    def __init__(self, size: int, timeout: float):
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def exchange(self, rank: int, item: Any) -> list[Any]:
        self.slots[rank] = item
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return got


class ThreadComm:
    """One simulated rank of a CP group whose ranks are threads of this process (`simulate`).

    ``connected=False``: gathered tensors are detached copies and gradients travel through `_AllGather`'s
    reduce-scatter, run by each thread's own backward (CPU: autograd runs a CPU graph on the calling thread).
    ``connected=True``: the gathered tensors are the other ranks' own tensors, so the ranks' graphs join into one
    and a single backward on the main thread (of the sum of the ranks' losses) differentiates through every
    cross-rank edge. That is the mode for CUDA, where autograd runs one device thread that would block on a
    collective inside a backward; it checks the maths, not the collectives' backward."""

    def __init__(self, hub: _Hub, rank: int, connected: bool):
        self.hub, self.rank, self.size, self.connected = hub, rank, len(hub.slots), connected

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        got = self.hub.exchange(self.rank, x if self.connected else x.detach().clone())
        return got if self.connected else [t.clone() for t in got]

    def reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        got = self.hub.exchange(self.rank, [p.detach().clone() for p in parts])
        return functools.reduce(torch.add, [g[self.rank] for g in got])

    def all_reduce(self, x: torch.Tensor) -> None:
        x.copy_(functools.reduce(torch.add, self.hub.exchange(self.rank, x.detach().clone())))


def simulate(size: int, fn: Callable[[int, ThreadComm], Any], connected: bool = False, timeout: float = 300.0) -> list:
    """Run ``fn(rank, comm)`` for every rank of a CP group of ``size`` in threads of this process; returns the
    results in rank order. A rank that raises breaks the barrier, so the others fail instead of hanging."""
    hub = _Hub(size, timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadComm(hub, rank, connected))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[rank] = e
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"cp-rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raised = [e for e in errors if e is not None]
    if raised:  # the rank that failed first, not the ones its abort broke
        raise next((e for e in raised if not isinstance(e, threading.BrokenBarrierError)), raised[0])
    return results


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``x`` along ``dim``; backward: reduce-scatter the gradient (each rank's slice,
    summed over the ranks that used it, returns to its owner)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: DistComm | ThreadComm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return torch.cat(comm.all_gather(x.contiguous()), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = list(grad.chunk(ctx.comm.size, dim=ctx.dim))
        return ctx.comm.reduce_scatter(parts), None, None


class _Tie(torch.autograd.Function):
    """Identity on ``x`` whose backward also hands zero gradients to ``others``: keeps a collective's output in
    the graph on a rank that did not use it, so its backward (a collective) runs on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def all_gather(x: torch.Tensor, comm: DistComm | ThreadComm, dim: int) -> torch.Tensor:
    """Differentiable all-gather (concatenation in rank order along ``dim``)."""
    if comm.connected:
        return torch.cat(comm.all_gather(x), dim=dim)
    return _AllGather.apply(x, comm, dim)


# -- shards ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s contiguous slice [start, end) of a packed row."""

    rank: int
    size: int
    start: int
    end: int
    cu_seqlens: torch.Tensor  # [m + 1] the sequences inside the shard, local offsets 0 .. end - start
    pos_in_seg: torch.Tensor  # [end - start] each token's index inside its own sequence (global)
    carried: int  # tokens of the shard's first sequence that lie on earlier ranks (0: it starts here)

    @property
    def first_len(self) -> int:
        return int(self.cu_seqlens[1])


def shard_row(cu_seqlens: torch.Tensor, rank: int, size: int) -> Shard:
    """Rank ``rank``'s shard of a packed row with sequence bounds ``cu_seqlens`` (length a multiple of ``size``)."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    T = bounds[-1]
    if T % size:
        raise ValueError(f"a row of {T} tokens does not split into {size} equal shards (pad it: pad_micro_batch)")
    n = T // size
    start, end = rank * n, (rank + 1) * n
    seq = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    pos = (torch.arange(T) - torch.tensor(bounds)[seq])[start:end]
    local = [0, *(b - start for b in bounds if start < b < end), n]
    device = cu_seqlens.device
    return Shard(rank, size, start, end, torch.tensor(local, device=device), pos.to(device), int(pos[0]))


def pad_micro_batch(mb, multiple: int, pad_id: int = 0):
    """A packed micro-batch whose row length is a multiple of ``multiple``: a padding sequence appended at the
    end (pad ids, positions from 0, zero targets / loss mask / logprobs / advantages, expert 0 for replay)."""
    T = mb.input_ids.shape[1]
    pad = -T % multiple
    if pad == 0:
        return mb
    out: dict[str, Any] = {}
    for f in dataclasses.fields(mb):
        v = getattr(mb, f.name)
        if f.name == "cu_seqlens":
            v = torch.cat([v, v.new_tensor([T + pad])])
        elif f.name == "position_ids":
            v = torch.cat([v, torch.arange(pad, device=v.device, dtype=v.dtype)[None]], dim=1)
        elif f.name == "input_ids":
            v = F.pad(v, (0, pad), value=pad_id)
        elif torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == T:  # [B, T] and [layers, T, k]
            v = torch.cat([v, v.new_zeros(v.shape[0], pad, *v.shape[2:])], dim=1)
        out[f.name] = v
    return dataclasses.replace(mb, **out)


def shard_micro_batch(mb, shard: Shard):
    """The shard's slice of a packed micro-batch (``learner.packing.MicroBatch``, B = 1): every per-token tensor
    cut along the token axis, ``cu_seqlens`` local, ``position_ids`` the global in-sequence positions.
    ``segments`` still index the whole row (gather the shards' results first: `ContextParallel.gather`)."""
    if mb.cu_seqlens is None or mb.input_ids.shape[0] != 1:
        raise ValueError("context parallelism splits one packed row (cu_seqlens, B = 1)")
    T = mb.input_ids.shape[1]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(mb):
        v = getattr(mb, f.name)
        if f.name == "cu_seqlens":
            v = shard.cu_seqlens
        elif torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == T:
            v = v[:, shard.start : shard.end]
        out[f.name] = v
    return dataclasses.replace(mb, **out)


# -- CP-aware forwards of the token mixers -------------------------------------------------------------------


class ContextParallel:
    """CP over ``group`` (a ``torch.distributed`` group, None for the default one) or ``comm`` (e.g. a
    `ThreadComm`) for ``model``'s token mixers. Construction patches the mixers; `remove` restores them."""

    def __init__(self, model: nn.Module, group: Any = None, comm: DistComm | ThreadComm | None = None):
        from model.attention import GatedMLA, LinearAttention, SlidingWindowAttention

        self.comm = comm if comm is not None else DistComm(group)
        self.shard: Shard | None = None
        self.model = model
        self._patched: list[nn.Module] = []
        forwards = {LinearAttention: _linear_forward, SlidingWindowAttention: _sliding_forward, GatedMLA: _mla_forward}
        for module in model.modules():
            fn = forwards.get(type(module))
            if fn is not None:
                module.forward = functools.partial(self._dispatch, module, fn)
                self._patched.append(module)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def __deepcopy__(self, memo) -> "ContextParallel":
        """A deep copy of a patched model (e.g. the learner's KL reference) shares this CP (its group and its
        active shard): the copy's mixers run CP-aware inside the same ``sharded`` block."""
        return self

    def _dispatch(self, module: nn.Module, fn: Callable, *args, **kwargs):
        if self.shard is None:  # not inside `activate` / `sharded`: the module's own forward
            return type(module).forward(module, *args, **kwargs)
        return fn(module, self, *args, **kwargs)

    def remove(self) -> None:
        for module in self._patched:
            del module.forward
        self._patched = []

    @contextmanager
    def activate(self, shard: Shard) -> Iterator[Shard]:
        """Mixers run CP-aware on ``shard`` inside the block. Run the backward inside it too when the model
        recomputes activations (gradient checkpointing repeats the forward's collectives)."""
        if shard.size != self.size or shard.rank != self.rank:
            raise ValueError(f"shard {shard.rank}/{shard.size} for CP rank {self.rank}/{self.size}")
        prev, self.shard = self.shard, shard
        try:
            yield shard
        finally:
            self.shard = prev

    @contextmanager
    def sharded(self, mb, pad_id: int = 0) -> Iterator[Any]:
        """This rank's slice of a packed micro-batch (padded to a multiple of the CP size), with the mixers
        CP-aware. Its per-token tensors are the shard's: normalise losses by the whole row's
        ``mb.num_loss_tokens``."""
        full = pad_micro_batch(mb, self.size, pad_id)
        shard = shard_row(full.cu_seqlens, self.rank, self.size)
        local = shard_micro_batch(full, shard)
        with self.activate(shard):
            yield local

    @torch.no_grad()
    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every shard's ``x`` concatenated in row order along ``dim`` (no gradient): e.g. [1, T] logprobs."""
        return torch.cat(self.comm.all_gather(x.contiguous()), dim=dim)

    @torch.no_grad()
    def all_reduce_gradients(self, params=None) -> None:
        """Sum the parameter gradients over the CP group (each rank holds its shard's partial sum)."""
        params = self.model.parameters() if params is None else params
        for p in params:
            if p.grad is not None:
                self.comm.all_reduce(p.grad)

    # helpers for the mixers ----------------------------------------------------------------------------------
    def halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, T, ...] (this shard) -> [B, n, ...]: the n tokens just before the shard, zeros before the row
        start. Gathers each rank's last min(n, T) tokens, so a halo wider than a shard spans several."""
        B, T = x.shape[:2]
        if n == 0:
            return x[:, :0]
        tails = all_gather(x[:, T - min(n, T) :], self.comm, dim=1)  # [B, size * m, ...]
        before = tails[:, : self.rank * min(n, T)][:, -n:] if self.rank else tails[:, :0]
        if before.shape[1] < n:
            before = torch.cat([before.new_zeros(B, n - before.shape[1], *x.shape[2:]), before], dim=1)
        return _Tie.apply(before, tails)


def _check_plain(cache, mask) -> None:
    if cache is not None or mask is not None:
        raise ValueError("context parallelism runs packed training rows: no cache, no padding mask")


def _linear_forward(self, cp: ContextParallel, x, cache=None, pos_in_seg=None, cu_seqlens=None, token_mask=None):
    """`LinearAttention.forward` on a shard: conv halos, zero-state shard run, state passing."""
    _check_plain(cache, token_mask)
    shard = cp.shard
    K = self.head_k_dim
    projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
    widths = [p.shape[-1] for p in projected]
    halos = cp.halo(torch.cat(projected, dim=-1), self.q_conv1d.kernel - 1).split(widths, dim=-1)
    q, k, v, _ = self.conv_heads(*projected, halos, shard.pos_in_seg)  # [B, T, H, K|V]
    fused = self.fused_gate
    run = shard_pass(q, k, v, self.chunk_gate(x), self.beta(x), shard.cu_seqlens, shard.carried > 0,
                     bounded_gate=fused, gate_lower_bound=self.g_min if fused else None)
    states = all_gather(torch.cat([run.M, run.h_ext], dim=-1), cp.comm, dim=0)  # [size, H, K, K + V] fp32
    h_in = fold_incoming(states[..., :K], states[..., K:], shard.rank)  # [H, K, V]
    return self.output(_Tie.apply(add_incoming(run.o, run.q_eff, h_in), states), x)


CARRIED_BLOCK_BYTES = 1 << 26  # fp32 mask bytes per block of queries of a carried sequence (64 MiB) ...
CARRIED_MIN_BLOCK = 256  # ... unless that leaves fewer queries per block than this


def _attend_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, carried: int, shard: Shard,
                  window: int | None) -> torch.Tensor:
    """Causal attention of the shard's queries q [B, Hq, T, d] over k/v [B, Hkv, carried + T, d]: the first
    sequence's ``carried`` earlier tokens, then the shard's own. Sequences that start in the shard go through
    the model's own `attend` (packed, ``cu_seqlens``); a carried first sequence through `_attend_carried`."""
    from model.attention.sdpa import attend

    T, first = q.shape[2], shard.first_len
    span = carried + first
    if carried:
        parts = [_attend_carried(q[:, :, :first], k[:, :, :span], v[:, :, :span], carried, window)]
    else:
        parts = [attend(q[:, :, :first], k[:, :, :first], v[:, :, :first], 0, window)]
    if first < T:
        rest = shard.cu_seqlens[1:] - first
        parts.append(attend(q[:, :, first:], k[:, :, span:], v[:, :, span:], 0, window, rest))
    return torch.cat(parts, dim=2)


def _attend_carried(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, carried: int, window: int | None) -> torch.Tensor:
    """q [B, Hq, n, d]: tokens carried .. carried + n - 1 of one sequence; k/v [B, Hkv, carried + n, d] from its
    first token. Queries run in blocks, each over the keys it can see (all earlier ones, or the window) with
    the explicit causal mask `attend` builds for an offset (``past``); each block is recomputed in the backward
    (activation checkpointing), so no [n, carried + n] mask or score block outlives its block."""
    from model.attention.sdpa import attend

    n = q.shape[2]
    elems = CARRIED_BLOCK_BYTES // 4
    block = elems // (carried + n) if window is None else int(elems**0.5)  # a window's keys: block + window - 1
    block = max(CARRIED_MIN_BLOCK, block)
    out = []
    for i in range(0, n, min(n, block)):
        j = min(n, i + block)
        lo = 0 if window is None else max(0, carried + i - window + 1)
        args = (q[:, :, i:j], k[:, :, lo : carried + j], v[:, :, lo : carried + j], carried + i - lo, window)
        out.append(checkpoint(attend, *args, use_reentrant=False) if torch.is_grad_enabled() else attend(*args))
    return torch.cat(out, dim=2)


def _sliding_forward(self, cp: ContextParallel, x, position_ids, cache=None, cu_seqlens=None, attn_mask_2d=None):
    """`SlidingWindowAttention.forward` on a shard: a halo of the previous window - 1 rotated keys / values."""
    from model.rope import apply_rotary

    _check_plain(cache, attn_mask_2d)
    shard = cp.shard
    B, T, _ = x.shape
    Hq, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
    cos, sin = self.rotary(position_ids)
    q = apply_rotary(self.q_proj(x).view(B, T, Hq, hd), cos, sin)
    k = apply_rotary(self.k_proj(x).view(B, T, Hkv, hd), cos, sin)
    v = self.v_proj(x).view(B, T, Hkv, hd)
    n = self.window - 1
    carried = min(n, shard.carried)
    halo = cp.halo(torch.cat([k, v], dim=-1), n)[:, n - carried :]  # [B, carried, Hkv, 2 hd]
    kv = torch.cat([halo, torch.cat([k, v], dim=-1)], dim=1).transpose(1, 2)  # [B, Hkv, carried + T, 2 hd]
    o = _attend_shard(q.transpose(1, 2), kv[..., :hd], kv[..., hd:], carried, shard, self.window)
    return self.o_proj(o.transpose(1, 2).reshape(B, T, Hq * hd))


def _mla_forward(self, cp: ContextParallel, x, position_ids, cache=None, cu_seqlens=None, attn_mask_2d=None):
    """`GatedMLA.forward` on a shard: all-gather of the latent, keys/values rebuilt from it locally."""
    from model.rope import apply_rotary

    _check_plain(cache, attn_mask_2d)
    shard = cp.shard
    B, T, _ = x.shape
    H = self.num_heads
    q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q_nope, q_pe = q.view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
    c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
    c_kv = self.kv_a_layernorm(c_kv)
    if self.rotary is not None:
        cos, sin = self.rotary(position_ids)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin).squeeze(2)
    latent = all_gather(torch.cat([c_kv, k_pe], dim=-1), cp.comm, dim=1)  # [B, size * T, r + rope]
    carried = shard.carried
    c_kv, k_pe = latent[:, shard.start - carried : shard.end].split([self.kv_lora_rank, self.rope], dim=-1)
    S = carried + T
    k_nope, v = self.kv_b_proj(c_kv).view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.rope)], dim=-1).transpose(1, 2)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    o = _attend_shard(q, k, v.transpose(1, 2), carried, shard, None)  # [B, H, T, v]
    return self.output(o.transpose(1, 2), x)


def apply_context_parallel(model: nn.Module, group: Any = None, comm: DistComm | ThreadComm | None = None) -> ContextParallel:
    """Make ``model``'s token mixers CP-aware over ``group`` (or ``comm``); see `ContextParallel`."""
    return ContextParallel(model, group, comm)
