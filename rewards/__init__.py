"""Reward configs: weighted, named reward terms loaded from YAML (format: ``rewards/README.md``)."""

from rewards.config import (
    DEFAULT_PATH,
    RewardConfig,
    RewardConfigError,
    RewardTermError,
    TermSpec,
    load_reward_config,
)

__all__ = ["DEFAULT_PATH", "RewardConfig", "RewardConfigError", "RewardTermError", "TermSpec", "load_reward_config"]
