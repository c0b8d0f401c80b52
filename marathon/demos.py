"""Oracle demonstrations for the SFT warm start, as a ``datasets.Dataset`` of token ids and loss masks.

Each demo is one whole episode played by the env's scripted oracle (``env.oracle_action()``) and encoded
exactly as a rollout encodes it (``rollout.chat``): the opening prompt, each oracle turn as the ids a model
would sample (the canonical BPE of the text, then the eos when the turn is not a tool call), and each
observation as a template delta. Model turns have loss mask 1, everything else 0.
"""

from __future__ import annotations

from typing import Any

import datasets

import envs
from rollout.chat import ChatCodec, TokenEpisode


def oracle_episode(env: Any, seed: int, codec: ChatCodec, max_tokens: int) -> TokenEpisode | None:
    """One oracle episode as tokens; None if it does not succeed within ``max_tokens``."""
    obs, _ = env.reset(seed=seed)
    tools = obs.get("tools")
    ep = TokenEpisode.start(codec.prompt_ids(obs["messages"], tools))
    while True:
        action = env.oracle_action()
        turn = list(codec.tokenizer.encode(action, add_special_tokens=False))
        if not turn or turn[-1] != codec.tool_call_end_id:
            turn.append(codec.eos_id)  # a final answer ends with eos; a tool call stops on its end tag
        ep.add_model_turn(turn, [0.0] * len(turn))
        obs, _, terminated, truncated, info = env.step(codec.turn_text(turn))
        if terminated or truncated:
            return ep if info.get("success") and len(ep) <= max_tokens else None
        ep.add_observation(codec.observation_ids(turn, obs["messages"], tools))


def build_demos(env_id: str, env_kwargs: dict[str, Any], seeds: list[int], codec: ChatCodec,
                max_tokens: int) -> datasets.Dataset:
    """Demos for ``seeds`` (those the oracle cannot finish within ``max_tokens`` are left out)."""
    env = envs.make(env_id, **env_kwargs)

    def rows():
        for seed in seeds:
            ep = oracle_episode(env, seed, codec, max_tokens)
            if ep is not None:
                yield {"seed": seed, "token_ids": ep.token_ids, "loss_mask": ep.loss_mask}

    try:
        data = datasets.Dataset.from_list(list(rows()))
    finally:
        env.close()
    if len(data) == 0:
        raise ValueError(f"the oracle of {env_id} finished no episode within {max_tokens} tokens")
    return data
