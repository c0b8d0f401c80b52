"""Token logprobs of a causal LM without [T, vocab] logits: the learner's logprob + loss head.

The plain path (``lm_head(hidden).float().log_softmax(-1)``) holds about 10 bytes per logit at once (bf16 logits,
their fp32 copy, the fp32 log-softmax): 640 GiB per tensor at 1M tokens and a 160K vocabulary, 125 GiB measured
at 64K on the H200. Here the hidden states of only the positions that are scored (the loss's model tokens;
prompt and tool-output positions are skipped) go through the head ``chunk_tokens`` rows at a time, each chunk
under activation checkpointing: the forward keeps one [chunk, vocab] block alive and saves nothing but the
chunk's hidden rows; the backward recomputes that block. The head module itself is called, so its own hooks
(DeepSpeed ZeRO-3's parameter gathering) fire as in the plain path. Same idea as prime-rl's fused LM head; verl
#2656 is why the tests compare against the plain path.

The learner's training step goes one further (``fused_head_loss``): its losses are sums of per-token terms of
logp, so each block's gradients are taken in the forward, beside the loss, and the block is never recomputed.

Logprobs are of pi / temperature: the rollout engine samples (and reports logprobs) from softmax(logits / T),
so the learner must score the same distribution or every importance ratio is biased.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from learner.compile import compile_fn
from learner.packing import MicroBatch

CHUNK_TOKENS = 1024  # rows per head block: 1024 x 160K vocab x 4 B = 640 MiB per fp32 block

# A loss that is a sum of per-token terms: (logp [n] fp32, rows [n] long: flat [B * T] positions) -> [n]
TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [n, vocab], targets [n] -> log softmax(logits / temperature)[target] [n] fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    compiled: bool) -> torch.Tensor:
    """hidden [n, D], targets [n] -> [n] fp32 through the head module (its hooks fire)."""
    return (compile_fn(_logprobs) if compiled else _logprobs)(head(hidden), targets, temperature)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk_tokens: int = CHUNK_TOKENS, compiled: bool = False) -> torch.Tensor:
    """hidden [n, D], targets [n] -> [n] fp32, ``chunk_tokens`` rows at a time, each recomputed in backward.
    ``compiled``: each block's cast, scaling, gather and logsumexp of the fp32 [chunk, vocab] block fused by
    ``torch.compile``, forward and backward (``learner.compile``)."""
    if hidden.shape[0] <= chunk_tokens and not torch.is_grad_enabled():
        return _chunk_logprobs(head, hidden, targets, temperature, compiled)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, head, h, t, temperature, compiled, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, temperature, compiled))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


class _FusedHeadLoss(torch.autograd.Function):
    """The head and a per-token loss, with the gradients computed in the forward.

    The loss is a sum of per-token terms of logp (``TokenLoss``), so each [chunk, vocab] block's logit gradient is
    known as soon as the block is: the forward runs the block's matmul, takes d loss / d logits through the
    log-softmax and the loss terms by autograd, and then the two gradient matmuls (d hidden = d logits W, d W +=
    d logits^T hidden); the backward only scales what the forward left. Three [chunk, D] x [D, vocab] matmuls per
    block instead of the checkpointed head's four (its backward runs the block's forward again), and nothing of
    the block outlives it. Liger-Kernel's chunked losses do the same (``fused_linear_ppo.py``,
    https://github.com/linkedin/Liger-Kernel); here the loss terms are the learner's own (``learner.losses``)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, token_loss, temperature, chunk_tokens, compiled):
        # hidden [n, D], weight [vocab, D], targets / rows [n] -> loss sum [] fp32, logp [n] fp32 (no gradient)
        grad_hidden = torch.empty_like(hidden)  # [n, D]
        grad_weight = torch.zeros_like(weight)  # [vocab, D], accumulated in place by each block's matmul
        loss = hidden.new_zeros((), dtype=torch.float32)
        parts = []
        for start in range(0, hidden.shape[0], chunk_tokens):
            block = slice(start, start + chunk_tokens)
            block_loss, logp = _block_gradients(hidden[block], weight, targets[block], rows[block], token_loss,
                                                temperature, compiled, grad_hidden[block], grad_weight)
            loss += block_loss
            parts.append(logp)
        ctx.save_for_backward(grad_hidden, grad_weight)
        logp = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(logp)
        return loss, logp

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), \
            None, None, None, None, None, None


def _block_gradients(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                     token_loss: TokenLoss, temperature: float, compiled: bool, grad_h: torch.Tensor,
                     grad_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of ``_FusedHeadLoss``: h [c, D] -> (its loss terms' sum [], logp [c]), writing d loss / d h into
    grad_h [c, D] and adding d loss / d weight into grad_weight [vocab, D]. Its [c, vocab] blocks die with it."""
    logits = (h @ weight.T).requires_grad_()  # [c, vocab], a leaf: autograd stops here
    with torch.enable_grad():
        logp = (compile_fn(_logprobs) if compiled else _logprobs)(logits, targets, temperature)  # [c]
        block_loss = token_loss(logp, rows).sum()
        (grad_logits,) = torch.autograd.grad(block_loss, logits)  # [c, vocab]
    torch.mm(grad_logits, weight, out=grad_h)
    grad_weight.addmm_(grad_logits.T, h)
    return block_loss.detach(), logp.detach()


def fusable_head(head: torch.nn.Module) -> bool:
    """Whether ``fused_head_loss`` can take this head: a bias-free linear whose weight is materialised (not a
    ZeRO-3 partition, which only DeepSpeed's hooks around the module's own call gather)."""
    return isinstance(head, torch.nn.Linear) and head.bias is None and not hasattr(head.weight, "ds_id")


def fused_head_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                    token_loss: TokenLoss, temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                    compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [n, D], targets [n], rows [n] (what ``token_loss`` is told) -> (sum of the loss terms [] fp32, with
    the gradient of hidden and the head's weight; logp [n] fp32, detached), ``chunk_tokens`` rows at a time."""
    if not fusable_head(head):
        raise ValueError(f"the fused head needs a bias-free nn.Linear with a materialised weight, got {head!r}")
    return _FusedHeadLoss.apply(hidden, head.weight, targets, rows, token_loss, temperature, chunk_tokens, compiled)


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


def _scored_rows(model: torch.nn.Module, mb: MicroBatch, accepted: set[str], all_positions: bool):
    """The decoder's forward -> (head module, hidden [n, D] and targets [n] of the scored positions, their flat
    [B * T] indices [n])."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    hidden = module.get_decoder()(**forward_kwargs_for(mb, accepted)).last_hidden_state  # [B, T, D]
    keep = torch.ones_like(mb.loss_mask, dtype=torch.bool) if all_positions else mb.loss_mask != 0  # [B, T]
    idx = keep.flatten().nonzero().squeeze(-1)  # [n]
    return (module.get_output_embeddings(), hidden.flatten(0, 1).index_select(0, idx),
            mb.targets.flatten().index_select(0, idx), idx)


def _scatter(scored: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """scored [n] at flat indices idx -> [B, T] like ``like``, 0 elsewhere."""
    out = torch.zeros(like.numel(), device=scored.device, dtype=torch.float32)
    return out.index_put((idx,), scored).view_as(like)


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, accepted: set[str], temperature: float = 1.0,
                   all_positions: bool = False, chunk_tokens: int = CHUNK_TOKENS,
                   compiled: bool = False) -> torch.Tensor:
    """log pi_T(target_t | ids_<=t) [B, T] fp32 where ``mb.loss_mask`` is set (every position with
    ``all_positions``), 0 elsewhere. ``model``: an HF causal LM (or a DeepSpeed engine around one) whose
    decoder returns ``last_hidden_state`` and whose output embeddings are the LM head. ``compiled``: the head's
    blocks through ``torch.compile``."""
    head, hidden, targets, idx = _scored_rows(model, mb, accepted, all_positions)
    return _scatter(head_logprobs(head, hidden, targets, temperature, chunk_tokens, compiled), idx, mb.loss_mask)


def token_loss_and_logprobs(model: torch.nn.Module, mb: MicroBatch, accepted: set[str], token_loss: TokenLoss,
                            temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                            compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_loss`` summed over the loss positions (its backward reaches every parameter) and the logprobs
    [B, T] of ``token_logprobs`` (detached), through the fused head (``fused_head_loss``): the head's gradients
    are computed in the forward. ``token_loss`` gets the flat [B * T] positions of its logprobs."""
    head, hidden, targets, idx = _scored_rows(model, mb, accepted, False)
    loss, logp = fused_head_loss(head, hidden, targets, idx, token_loss, temperature, chunk_tokens, compiled)
    return loss, _scatter(logp, idx, mb.loss_mask)
