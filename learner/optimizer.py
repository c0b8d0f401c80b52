"""``FlatAdamW``: AdamW on fp32 master weights for a bf16 model, over one flat fp32 buffer per parameter group.

In bf16 at ZeRO-0, DeepSpeed wraps a torch optimizer in its ``FP16_UnfusedOptimizer``, which checks each gradient
for inf/NaN with a host sync, takes each one's norm, casts each to fp32 and copies each weight back on its own; its
own ``FusedAdam`` gets the flat ``FP16_Optimizer``, which keeps the per-parameter checks and casts. This optimizer
does the same update with no per-parameter host work:

    g      = fp32(bf16 grads), into one flat buffer            one foreach copy            [N] per group
    norm   = ||g||_2 over every group                          one norm per group
    master = AdamW(master, g / max(1, (norm + 1e-6) / max_norm))  torch's fused AdamW on [N]; skipped where norm
                                                               is not finite (its grad_scale and found_inf)
    w      = bf16(master)                                      one foreach copy

For the 1.90B parameters (240 tensors) of ``learner-bench`` on one H100: 54.7 ms per step against 103.2 for
DeepSpeed's wrapper, the same memory (``gpu_probe.py step``, ``benchmarks/learner/h100/README.md``).

The model's bf16 parameters stay its parameters. The master weights and both moments live in an inner torch fused
AdamW over the flat buffers (``self.optimizer``, where ``learner.data_parallel.state_bytes`` finds them), allocated
up front. Its first step is AdamW's first (bias corrections at t = 1), as the fp32 learner's bare torch AdamW;
DeepSpeed's wrapper takes a zero-gradient step at start-up, so its first update runs at t = 2, after the weights
decayed once with no gradient. bf16 needs no overflow check (fp32's exponent range); a non-finite norm skips the
step as DeepSpeed's wrappers do (``overflow``, read by DeepSpeed after the step: the step's one host sync).

The learner hands it to DeepSpeed as a client optimizer, with DeepSpeed's bf16 mode and clipping off
(``learner.engine.ds_config``): DeepSpeed runs the backward, gradient accumulation, the data-parallel all-reduce and
checkpoints, and calls ``step``. ZeRO 1-3 partition the optimizer and keep DeepSpeed's own.
"""

from __future__ import annotations

from typing import Any

import torch


class FlatAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.max_grad_norm = max_grad_norm
        self._global_grad_norm: torch.Tensor | None = None  # DeepSpeed's engine reports it after the step
        self._found_inf: torch.Tensor | None = None
        masters = []
        for group in self.param_groups:
            ps = group["params"]
            master = torch.empty(sum(p.numel() for p in ps), dtype=torch.float32, device=ps[0].device)  # [N]
            torch._foreach_copy_(_views(master, ps), [p.detach() for p in ps])
            masters.append(master)
        self.optimizer = torch.optim.AdamW([{"params": [m]} for m in masters], lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay, fused=True)
        for m in masters:  # the moments now, as torch would make them at the first step (memory is taken up front)
            self.optimizer.state[m] = {"step": torch.zeros((), dtype=torch.float32, device=m.device),
                                       "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped (a non-finite gradient norm); read by DeepSpeed's engine."""
        return self._found_inf is not None and bool(self._found_inf)

    @property
    def masters(self) -> list[torch.Tensor]:
        """The flat fp32 master weights, one per parameter group."""
        return [g["params"][0] for g in self.optimizer.param_groups]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "FlatAdamW takes no closure"
        grads = []
        for group, master in zip(self.param_groups, self.masters):
            g = torch.empty_like(master)  # [N] fp32, alive only inside the step
            views, ps = _views(g, group["params"]), group["params"]
            if have := [i for i, p in enumerate(ps) if p.grad is not None]:
                torch._foreach_copy_([views[i] for i in have], [ps[i].grad for i in have])
            if missing := [v for v, p in zip(views, ps) if p.grad is None]:
                torch._foreach_zero_(missing)
            grads.append(g)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # 0-d fp32
        self._global_grad_norm = norm
        self._found_inf = (~torch.isfinite(norm)).float()
        for group, inner, master, g in zip(self.param_groups, self.optimizer.param_groups, self.masters, grads):
            inner.update({k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
            master.grad = g
        # the fused step divides the gradients by grad_scale (clipping) and leaves weights, moments and step count
        # as they were where found_inf is 1
        self.optimizer.grad_scale = ((norm + 1e-6) / self.max_grad_norm).clamp(min=1.0) if self.max_grad_norm > 0 \
            else torch.ones_like(norm)
        self.optimizer.found_inf = self._found_inf
        self.optimizer.step()
        for group, master in zip(self.param_groups, self.masters):
            master.grad = None
            torch._foreach_copy_(group["params"], _views(master, group["params"]))

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.optimizer.state_dict(), "masters": self.masters,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The master weights and moments as saved; the model's weights become bf16 of the saved masters."""
        if len(state_dict["masters"]) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(state_dict['masters'])} parameter groups, the optimizer "
                             f"{len(self.param_groups)}")
        with torch.no_grad():
            for group, master, saved, meta in zip(self.param_groups, self.masters, state_dict["masters"],
                                                  state_dict["param_groups"]):
                if saved.numel() != master.numel():
                    raise ValueError(f"checkpoint's master weights have {saved.numel()} elements, the model "
                                     f"{master.numel()}")
                master.copy_(saved)
                group.update(meta)
                torch._foreach_copy_(group["params"], _views(master, group["params"]))
        self.optimizer.load_state_dict(state_dict["adamw"])


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` [N] cut into tensors shaped as ``params`` (in order)."""
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params)]
