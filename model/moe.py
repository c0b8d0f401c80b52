"""Mixture of experts: sigmoid router with logit clipping, top-k, quantile balancing (no auxiliary loss),
fine-grained SwiGLU experts computed as grouped matmuls over expert-sorted tokens, plus shared experts.

Routing, per token (N tokens, E experts):
    s        = sigmoid(clamp(x W_r^T, -c, c))                       [N, E] fp32, c = router_logit_clip
    select   = top-k of  s * scale   ("quantile" mode)  |  s + b  ("bias" mode)  |  s  ("none")
    weights  = s[select] / sum(s[select]) * routed_scaling_factor   (unbiased scores: balancing never
               changes the weights' values, only which experts are picked)

Balancing state (buffers, saved in the checkpoint) moves only when the weights do, so it never drifts inside an
update: a training-mode forward with gradients enabled stashes its routing statistics (`Router._stash`; no-grad
passes such as old-policy logprobs or evaluation stash nothing), the stashes of all forwards of one update add up
(one entry per forward, keyed by the model's forward id, so gradient checkpointing's recompute replaces its
forward's entry instead of counting it twice), and the next optimizer step folds them into the buffers
(`Router.apply_pending`, run by a global torch optimizer step post-hook on every router with stashed statistics;
`MarathonModel.apply_router_updates()` does it by hand for training loops without a torch optimizer). Between two
steps every forward - old-policy logprobs, each micro-batch, its recompute - routes with the same state.
    "quantile": relative load EMA (1.0 = fair share); experts above the `router_high_quantile` of the EMA get
                scale *= router_shrink_factor, those below `router_low_quantile` scale *= router_boost_factor.
    "bias":     alpha_i = (k+1)-th largest of s_i + b;  r_ij = alpha_i - s_ij;
                b_j <- quantile_i(r_ij, k/E);  b <- b - mean(b)   (DESIGN_NOTES' published form)

Expert weights: `experts.gate_up_proj` [E, D, 2F] (gate = first F columns, up = last F), `experts.down_proj`
[E, F, D] - (in, out) layout, as `kernels.grouped_mm_reference` takes them.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import kernels
from model.chunking import over_tokens
from model.config import MarathonConfig

_FORWARD_IDS = itertools.count()
_STASHED: "weakref.WeakSet[Router]" = weakref.WeakSet()  # routers holding statistics for the next optimizer step


def new_forward_id() -> int:
    """A key for one forward's routing statistics (`Router.forward`'s ``key``)."""
    return next(_FORWARD_IDS)


def apply_stashed_routing(*_args, **_kwargs) -> None:
    """Fold every router's stashed statistics into its balancing state (the optimizer step post-hook)."""
    for router in list(_STASHED):
        router.apply_pending()


register_optimizer_step_post_hook(apply_stashed_routing)


class SwiGLU(nn.Module):
    """Dense MLP (first_k_dense layers) and the shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config: MarathonConfig):
        super().__init__()
        E = config.n_routed_experts
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        fp32 = torch.float32
        self.register_buffer("load_ema", torch.ones(E, dtype=fp32))  # relative load, 1.0 = fair share
        self.register_buffer("expert_scale", torch.ones(E, dtype=fp32))  # "quantile" mode selection scale
        self.register_buffer("expert_bias", torch.zeros(E, dtype=fp32))  # "bias" mode selection bias
        # tokens routed to each expert by this update's forwards so far (after a step: that update's, all ranks)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=fp32), persistent=False)
        # forward id -> (counts [E], bias-mode quantile estimate [E] or None, tokens) of this update's forwards
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}

    def _apply(self, fn, recurse=True):
        """Balancing buffers stay fp32 whatever dtype the model is cast to (bf16 would swallow small updates)."""
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> sigmoid scores [N, E] fp32."""
        logits = F.linear(x.float(), self.weight.float())
        return torch.sigmoid(logits.clamp(-self.config.router_logit_clip, self.config.router_logit_clip))

    def selection_scores(self, s: torch.Tensor) -> torch.Tensor:
        mode = self.config.router_balance_mode
        if mode == "quantile":
            return s * self.expert_scale
        if mode == "bias":
            return s + self.expert_bias
        return s

    def route(self, s: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores s [N, E] -> (weights [N, k] fp32, experts [N, k] int64): top-k over the balanced selection
        scores (or `forced` [N, k], a recorded selection to replay), weights from the unbiased scores,
        renormalised over the k and scaled. Pure: the vLLM plugin routes with it too."""
        if forced is None:
            with torch.no_grad():
                idx = self.selection_scores(s).topk(self.top_k, dim=-1).indices
        else:
            if forced.shape != (s.shape[0], self.top_k):
                raise ValueError(f"routed_experts for this layer must be [{s.shape[0]}, {self.top_k}], got {list(forced.shape)}")
            idx = forced.to(s.device, torch.long)
        w = s.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-20) * self.config.routed_scaling_factor
        return w, idx

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None,
                key: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, experts [N, k] int64). Training forwards with gradients enabled stash
        the routing statistics under ``key`` (the model's forward id; None: a forward of its own), replacing an
        earlier stash of the same key (gradient checkpointing's recompute)."""
        s = self.scores(x)
        w, idx = self.route(s, forced)
        if self.training and torch.is_grad_enabled():
            self._stash(s.detach(), idx, new_forward_id() if key is None else key)
        return w, idx

    @torch.no_grad()
    def _stash(self, s: torch.Tensor, idx: torch.Tensor, key: int) -> None:
        E = s.shape[-1]
        counts = torch.bincount(idx.reshape(-1), minlength=E).float()
        bias_estimate = None
        if self.config.router_balance_mode == "bias" and s.shape[0] > 0:
            k = self.top_k
            alpha = (s + self.expert_bias).topk(k + 1, dim=-1).values[:, -1:]  # [N, 1]
            r = alpha - s  # [N, E]
            rank = max(1, round(k / E * s.shape[0]))
            bias_estimate = r.kthvalue(rank, dim=0).values  # [E] quantile at level k/E
        self._pending[key] = (counts, bias_estimate, s.shape[0])
        self.tokens_per_expert.copy_(sum(c for c, _, _ in self._pending.values()))  # this update's so far
        _STASHED.add(self)

    def discard_pending(self) -> None:
        """Drop the stashed statistics (forwards whose gradients will not be applied)."""
        self._pending = {}
        _STASHED.discard(self)

    @torch.no_grad()
    def apply_pending(self) -> None:
        """Fold the statistics of the training forwards since the last update into the balancing buffers: one
        update from their summed expert counts (and, "bias" mode, the token-weighted mean of their quantile
        estimates), summed / averaged over the data-parallel ranks."""
        if not self._pending:
            return
        entries = list(self._pending.values())
        self.discard_pending()
        counts = torch.stack([c for c, _, _ in entries]).sum(0)
        weighted = [(b, n) for _, b, n in entries if b is not None and n > 0]
        bias_estimate = None
        if weighted:
            bias_estimate = sum(b * n for b, n in weighted) / sum(n for _, n in weighted)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
            if bias_estimate is not None:
                dist.all_reduce(bias_estimate)
                bias_estimate /= dist.get_world_size()
        cfg, E = self.config, counts.numel()
        self.tokens_per_expert.copy_(counts)
        total = counts.sum()
        if total == 0:
            return
        load = counts * E / total  # 1.0 = fair share
        self.load_ema.mul_(cfg.router_ema_decay).add_((1 - cfg.router_ema_decay) * load)
        if cfg.router_balance_mode == "quantile":
            hi = torch.quantile(self.load_ema, cfg.router_high_quantile)
            lo = torch.quantile(self.load_ema, cfg.router_low_quantile)
            factor = torch.ones_like(self.expert_scale)
            factor[self.load_ema > hi] = cfg.router_shrink_factor
            factor[self.load_ema < lo] = cfg.router_boost_factor
            self.expert_scale.mul_(factor).clamp_(*cfg.router_scale_bounds)
        elif cfg.router_balance_mode == "bias" and bias_estimate is not None:
            target = bias_estimate - bias_estimate.mean()
            self.expert_bias.mul_(1 - cfg.router_bias_rate).add_(cfg.router_bias_rate * target)

    def stats(self) -> dict:
        """Per-expert relative load (EMA and last batch), max/mean of the last batch, idle experts."""
        counts = self.tokens_per_expert
        mean = counts.mean().clamp(min=1e-9)
        return {
            "load_ema": self.load_ema.clone(),
            "tokens_per_expert": counts.clone(),
            "max_over_mean": float(counts.max() / mean),
            "dead_experts": int((counts == 0).sum()),
        }


class Experts(nn.Module):
    TOKEN_CHUNK = 1 << 17

    def __init__(self, config: MarathonConfig):
        super().__init__()
        E, D, Fi = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, D, 2 * Fi))
        self.down_proj = nn.Parameter(torch.empty(E, Fi, D))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights/idx [N, k] -> [N, D]. Long rows go ``TOKEN_CHUNK`` tokens at a time, with gradients
        each chunk recomputed in backward: the sorted copies of x (k rows per token) and the expert activations of
        a 1M-token row would otherwise take ~100 GiB at hidden 2048 and top-4 (44 GiB measured in a no-grad
        forward on the H200)."""
        return over_tokens(self._grouped, x, weights, idx, dim=0, chunk=self.TOKEN_CHUNK)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one grouped GEMM over the expert segments; the k expert outputs of each token
        weighted and summed back in token order (`kernels.gather_sum`). The dispatch is a gather whose backward is
        the same gather-sum over the inverse permutation (`_Dispatch`): no scatter, no atomic adds."""
        N, k = idx.shape
        E = self.gate_up_proj.shape[0]
        flat = idx.reshape(-1)  # [N*k], token-major
        order = torch.argsort(flat, stable=True)  # sorted slot -> token slot
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=order.device))
        offsets = F.pad(torch.bincount(flat, minlength=E).cumsum(0), (1, 0))  # [E+1]
        h = kernels.grouped_mm(_Dispatch.apply(x, order, inverse, k), self.gate_up_proj, offsets)  # [N*k, 2F]
        y = kernels.grouped_mm(self.activation(h), self.down_proj, offsets)  # [N*k, D] sorted
        return kernels.gather_sum(y, inverse, k, weights)  # [N, D]

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """[n, 2F] (gate, up) -> silu(gate) * up [n, F]."""
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up


class _Dispatch(torch.autograd.Function):
    """x [N, D] -> its rows in expert order, ``x[order // k]`` [N*k, D] (``order``: sorted slot -> token-major slot,
    ``inverse`` its inverse). Backward: each token's k row gradients gathered back and summed (`kernels.gather_sum`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return kernels.gather_sum(grad.contiguous(), inverse, ctx.k), None, None, None


class MoE(nn.Module):
    def __init__(self, config: MarathonConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None,
                key: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (out [B, T, D], selected experts [B*T, k]); ``key``: the forward id (`Router.forward`)."""
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        w, idx = self.router(flat, forced, key)
        out = self.experts(flat, w, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x), idx
