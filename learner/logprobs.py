"""Token logprobs of a causal LM without [T, vocab] logits: the learner's logprob + loss head.

The plain path (``lm_head(hidden).float().log_softmax(-1)``) holds about 10 bytes per logit at once (bf16 logits,
their fp32 copy, the fp32 log-softmax): 640 GiB per tensor at 1M tokens and a 160K vocabulary, 125 GiB measured
at 64K on the H200. Here the hidden states of only the positions that are scored (the loss's model tokens;
prompt and tool-output positions are skipped) go through the head ``chunk_tokens`` rows at a time, each chunk
under activation checkpointing: the forward keeps one [chunk, vocab] block alive and saves nothing but the
chunk's hidden rows; the backward recomputes that block. The head module itself is called, so its own hooks
(DeepSpeed ZeRO-3's parameter gathering) fire as in the plain path. Same idea as prime-rl's fused LM head; verl
#2656 is why the tests compare against the plain path.

Logprobs are of pi / temperature: the rollout engine samples (and reports logprobs) from softmax(logits / T),
so the learner must score the same distribution or every importance ratio is biased.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from learner.compile import compile_fn
from learner.packing import MicroBatch

CHUNK_TOKENS = 1024  # rows per head block: 1024 x 160K vocab x 4 B = 640 MiB per fp32 block


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """hidden [n, D], targets [n] -> log softmax(head(hidden) / temperature)[target] [n] fp32."""
    logits = head(hidden).float()  # [n, vocab]
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk_tokens: int = CHUNK_TOKENS, compiled: bool = False) -> torch.Tensor:
    """hidden [n, D], targets [n] -> [n] fp32, ``chunk_tokens`` rows at a time, each recomputed in backward.
    ``compiled``: each block's cast, scaling, gather and logsumexp of the fp32 [chunk, vocab] block fused by
    ``torch.compile``, forward and backward (``learner.compile``)."""
    fn = compile_fn(_chunk_logprobs) if compiled else _chunk_logprobs
    if hidden.shape[0] <= chunk_tokens and not torch.is_grad_enabled():
        return fn(head, hidden, targets, temperature)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(fn, head, h, t, temperature, use_reentrant=False))
        else:
            parts.append(fn(head, h, t, temperature))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def forward_kwargs_for(mb: MicroBatch, accepted: set[str]) -> dict[str, Any]:
    """The model inputs of a micro-batch, as the model's forward takes them."""
    kwargs: dict[str, Any] = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
    if mb.cu_seqlens is not None and "cu_seqlens" in accepted:
        kwargs["cu_seqlens"] = mb.cu_seqlens  # otherwise HF models detect the packing from position_ids
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask
    if mb.routed_experts is not None and "routed_experts" in accepted:
        kwargs["routed_experts"] = mb.routed_experts
    return kwargs


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, accepted: set[str], temperature: float = 1.0,
                   all_positions: bool = False, chunk_tokens: int = CHUNK_TOKENS,
                   compiled: bool = False) -> torch.Tensor:
    """log pi_T(target_t | ids_<=t) [B, T] fp32 where ``mb.loss_mask`` is set (every position with
    ``all_positions``), 0 elsewhere. ``model``: an HF causal LM (or a DeepSpeed engine around one) whose
    decoder returns ``last_hidden_state`` and whose output embeddings are the LM head. ``compiled``: the head's
    blocks through ``torch.compile``."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    hidden = module.get_decoder()(**forward_kwargs_for(mb, accepted)).last_hidden_state  # [B, T, D]
    keep = torch.ones_like(mb.loss_mask, dtype=torch.bool) if all_positions else mb.loss_mask != 0  # [B, T]
    idx = keep.flatten().nonzero().squeeze(-1)  # [n]
    scored = head_logprobs(module.get_output_embeddings(), hidden.flatten(0, 1).index_select(0, idx),
                           mb.targets.flatten().index_select(0, idx), temperature, chunk_tokens, compiled)  # [n]
    out = torch.zeros(keep.numel(), device=scored.device, dtype=torch.float32)
    return out.index_put((idx,), scored).view_as(mb.loss_mask)
