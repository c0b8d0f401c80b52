"""The MoE block on vLLM's fused MoE with our router (shared experts: `model.moe.SwiGLU`).

Routing is `model.moe.Router`'s, run as vLLM's custom routing function (the CPU router calls it; the fused
experts then apply the returned weights): sigmoid of clipped fp32 logits, top-k over the *selection* scores
(scale or bias from the checkpoint's balancing buffers), weights from the unbiased scores, renormalised,
times routed_scaling_factor. vLLM's routed-experts capture (`enable_return_routed_experts`) records the ids
this function returns.

Expert weights: HF `experts.gate_up_proj` [E, D, 2F] / `experts.down_proj` [E, F, D] (in, out) load expert by
expert into vLLM's `w13_weight` [E, 2F, D] (gate rows, then up) / `w2_weight` [E, D, F] (out, in).

Tensor parallelism (as vLLM's own MoE models): FusedMoE holds every expert with F / tp of its intermediate
width per rank; its weight loader takes the full per-expert tensors and narrows each of gate (w1), up (w3) and
down (w2) to this rank's slice itself (the fused gate|up layout is split per half, never as one block), and it
all-reduces the routed output. The router runs replicated (same routing on every rank). Shared experts and the
dense FFN are `ParallelSwiGLU`: intermediate split, own all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import FusedMoEFactory

from model.config import MarathonConfig
from model.moe import Router, SwiGLU
from rollout.vllm_plugin import tp


class ParallelSwiGLU(SwiGLU):
    """`model.moe.SwiGLU` (same parameter names) with its intermediate split across TP ranks: gate / up
    column-parallel [I/tp, D], down row-parallel [D, I/tp], the partial outputs all-reduced."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate // tp.tp_size())
        tp.column(self.gate_proj, self.up_proj)
        tp.row(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        return tp.all_reduce(super().forward(x))


class MarathonMoE(nn.Module):
    def __init__(self, config: MarathonConfig, prefix: str):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.router = Router(config)  # weight [E, D] + balancing buffers, loaded from the checkpoint
        self.experts = FusedMoEFactory(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
            prefix=f"{prefix}.experts",
            custom_routing_function=self.route,
            scoring_func="sigmoid",
            routed_scaling_factor=1.0,  # applied inside `route`
        )
        self.shared_experts = (
            ParallelSwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0
            else None
        )

    def route(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool):
        """vLLM custom routing function -> (weights [N, k] fp32, expert ids [N, k] int32). Recomputes the
        logits from hidden_states in fp32 (as the HF router) rather than trusting gating_output's dtype."""
        w, idx = self.router.route(self.router.scores(hidden_states))  # [N, k] each, k == topk
        return w, idx.to(torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        logits = torch.nn.functional.linear(x.float(), self.router.weight.float())  # [N, E] (shape for vLLM)
        out = self.experts(hidden_states=x, router_logits=logits)  # all-reduced by vLLM under TP
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> set[str]:
        """HF ``gate_up_proj`` [E, D, 2F] or ``down_proj`` [E, F, D] -> vLLM's per-expert weight loaders (which
        also serve vLLM's in-place reload: it re-runs the CPU prepacking once a layer is complete). Returns the
        vLLM parameter names filled."""
        params = {n.rsplit(".", 1)[-1]: (n, p) for n, p in self.experts.named_parameters()}
        for module in self.experts.modules():
            if "w13_weight" in module._parameters:
                _repack_on_update(module.quant_method)
        if name == "gate_up_proj":
            (pname, param), F_ = params["w13_weight"], tensor.shape[-1] // 2
            for e in range(tensor.shape[0]):
                param.weight_loader(param, tensor[e, :, :F_].t(), pname, shard_id="w1", expert_id=e)
                param.weight_loader(param, tensor[e, :, F_:].t(), pname, shard_id="w3", expert_id=e)
        elif name == "down_proj":
            pname, param = params["w2_weight"]
            for e in range(tensor.shape[0]):
                param.weight_loader(param, tensor[e].t(), pname, shard_id="w2", expert_id=e)
        else:
            raise KeyError(f"unknown expert tensor {name!r}")
        return {pname}


def _repack_on_update(method) -> None:
    """vLLM 0.32's unquantized MoE method skips the experts' own post-load step (the CPU grouped-GEMM
    prepacking) when it processes a weight *update* (`_setup_kernel`, `is_weight_update`), so an in-place
    reload would leave raw checkpoint-layout weights where the kernel expects packed ones. Re-run that step
    after an update; the reload machinery then copies the packed result into the served storage."""
    if getattr(method, "_marathon_repack", False):
        return
    process = method.process_weights_after_loading

    def process_and_repack(layer) -> None:
        update = method.moe_kernel is not None
        process(layer)
        if update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_and_repack
    method._marathon_repack = True
