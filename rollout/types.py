"""What a rollout produces and the learner consumes: one whole multi-round episode as token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One episode, token-in/token-out: ``token_ids`` is exactly what the model saw and sampled.

    All per-token lists have the same length L = len(token_ids):
      loss_mask[i]  1 for tokens the model sampled (trained), 0 for prompt / tool-output tokens
      logprobs[i]   the rollout engine's logprob of token i when loss_mask[i] == 1, else 0.0
    routed_experts, when recorded: [L][num_moe_layers][top_k] expert ids chosen by the rollout engine
    (for routing replay in the learner).
    """

    episode_id: str
    env_id: str
    seed: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    num_turns: int = 0
    success: bool = False
    truncated: bool = False
    reward: float | None = None
    reward_terms: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    routed_experts: list | None = None
    policy_version: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {self.episode_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"logprobs ({len(self.logprobs)}) must have the same length"
            )

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)
