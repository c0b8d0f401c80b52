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
      versions[i]   the policy version that sampled token i when loss_mask[i] == 1, else -1 (None: not
                    recorded, every model token is of ``policy_version``). With in-flight weight updates (async
                    rollouts) one episode holds tokens of several versions; ``logprobs[i]`` is always the
                    behaviour logprob under ``versions[i]``.
    routed_experts, when recorded: [L][num_moe_layers][top_k] expert ids chosen by the rollout engine
    (for routing replay in the learner).
    ``policy_version`` is the OLDEST version among the episode's model tokens (its staleness decides whether it
    may still be trained on).
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
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n or (self.versions is not None and len(self.versions) != n):
            raise ValueError(
                f"trajectory {self.episode_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}), "
                f"logprobs ({len(self.logprobs)}) and versions "
                f"({'-' if self.versions is None else len(self.versions)}) must have the same length"
            )

    def token_versions(self) -> list[int]:
        """Per-token versions (-1 on prompt / observation tokens), ``policy_version`` where none were recorded."""
        if self.versions is not None:
            return list(self.versions)
        return [self.policy_version if m else -1 for m in self.loss_mask]

    @property
    def num_versions(self) -> int:
        """Distinct policy versions among the model tokens (> 1: a partial rollout spanning a weight update)."""
        return len({v for v, m in zip(self.token_versions(), self.loss_mask) if m})

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)
