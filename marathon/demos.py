"""Oracle demonstrations for the SFT warm start, as a ``datasets.Dataset`` of token ids and loss masks.

Each demo is one whole episode played by the env's scripted oracle (``env.oracle_action()``) and encoded
exactly as a rollout encodes it (``rollout.chat``): the opening prompt, each oracle turn as the ids a model
would sample (the canonical BPE of the text, then the eos when the turn is not a tool call), and each
observation as a template delta. Model turns have loss mask 1, everything else 0.

Dataset envs (``envs/dataset.py``) replay each row's reference solution as their oracle; rows without one
are skipped (the env's ``has_oracle(seed)``), and ``sft_problem`` says up front when there are none.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets

import envs
from rollout.chat import ChatCodec, TokenEpisode

log = logging.getLogger(__name__)


def oracle_episode(env: Any, seed: int, codec: ChatCodec, max_tokens: int) -> TokenEpisode | None:
    """One oracle episode as tokens; None if it does not succeed within ``max_tokens``."""
    obs, _ = env.reset(seed=seed)
    tools = obs.get("tools")
    ep = TokenEpisode.start(codec.prompt_ids(obs["messages"], tools))
    while True:
        # the env itself, under whatever wrappers gymnasium.register added (OrderEnforcing, ...), which do not
        # forward attributes in gymnasium 1.x
        action = env.unwrapped.oracle_action()
        turn = list(codec.tokenizer.encode(action, add_special_tokens=False))
        if not turn or turn[-1] != codec.tool_call_end_id:
            turn.append(codec.eos_id)  # a final answer ends with eos; a tool call stops on its end tag
        ep.add_model_turn(turn, [0.0] * len(turn))
        obs, _, terminated, truncated, info = env.step(codec.turn_text(turn))
        if terminated or truncated:
            return ep if info.get("success") and len(ep) <= max_tokens else None
        ep.add_observation(codec.observation_ids(turn, obs["messages"], tools))


def sft_problem(env_id: str, env_kwargs: dict[str, Any]) -> str | None:
    """Why an SFT warm start cannot get demos from this env (None: it can). Dataset envs without reference
    solutions say so (``no_oracle_reason``); other envs need an ``oracle_action``."""
    env = envs.make(env_id, **env_kwargs)
    try:
        reason = getattr(env.unwrapped, "no_oracle_reason", None)
        if reason:
            return reason
        if not callable(getattr(env.unwrapped, "oracle_action", None)):
            return f"{env_id} has no oracle_action to make SFT demos from; set sft.steps: 0"
    finally:
        env.close()
    return None


def build_demos(env_id: str, env_kwargs: dict[str, Any], seeds: list[int], codec: ChatCodec,
                max_tokens: int) -> datasets.Dataset:
    """Demos for ``seeds`` (those the oracle cannot finish within ``max_tokens`` are left out, and so are
    rows of a dataset env without a reference solution, and seeds whose episode raised: env faults are data)."""
    env = envs.make(env_id, **env_kwargs)
    has_oracle = getattr(env.unwrapped, "has_oracle", lambda seed: True)
    failed: list[str] = []

    def rows():
        for seed in seeds:
            if not has_oracle(seed):
                continue
            try:
                ep = oracle_episode(env, seed, codec, max_tokens)
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"seed {seed}: {type(e).__name__}: {e}")
                continue
            if ep is not None:
                yield {"seed": seed, "token_ids": ep.token_ids, "loss_mask": ep.loss_mask}

    try:
        data = datasets.Dataset.from_list(list(rows()))
        reason = getattr(env.unwrapped, "no_oracle_reason", None)
    finally:
        env.close()
    if failed:
        log.warning("SFT demos: %d oracle episode(s) of %s raised and were left out; first: %s", len(failed), env_id,
                    failed[0])
    if len(data) == 0:
        raise ValueError(reason or (f"every oracle episode of {env_id} raised; first: {failed[0]}" if failed else
                                    f"the oracle of {env_id} finished no episode within {max_tokens} tokens"))
    return data
