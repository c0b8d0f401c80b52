"""Token-level encoding of a multi-round chat episode (token-in/token-out).

The opening messages are rendered once with the tokenizer's chat template (plus the generation prompt). After
that, ids only grow: a model turn appends exactly the sampled ids, and an environment observation appends the
ids of the NEW text only, rendered as a template delta (close the assistant turn, the observation messages, open
the next assistant turn). Earlier text is never re-tokenized, so the learner sees exactly the ids that were
sampled; re-rendering decoded text would not reproduce them (BPE merges across turn boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_PLACEHOLDER = "\u2063MARATHON_ASSISTANT_TURN\u2063"  # content of the template probe's assistant turn


class ChatCodec:
    """Chat-template encoding for one tokenizer (any HF tokenizer with a chat template)."""

    def __init__(self, tokenizer: Any, tool_call_end: str = "</tool_call>") -> None:
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        tool_end = tokenizer.convert_tokens_to_ids(tool_call_end)
        if tool_end is None or tool_end == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no single token for {tool_call_end!r}; it cannot stop on tool calls")
        self.tool_call_end_id: int = tool_end
        self.stop_token_ids: tuple[int, ...] = (tool_end, self.eos_id)
        # The fixed conversation that observation deltas are rendered after, and the text that closes an
        # assistant turn in this template (e.g. "<|im_end|>\n" in ChatML).
        self._probe = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _PLACEHOLDER},
        ]
        probe_text = self._render(self._probe, tools=None, generation_prompt=False)
        self._close_turn = probe_text[probe_text.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
        eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)
        self._close_after_eos = self._close_turn.removeprefix(eos_text)

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The opening messages (system/user) + the assistant generation prompt."""
        return self._encode(self._render(messages, tools, generation_prompt=True))

    def observation_ids(self, turn_ids: list[int], messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids that follow a model turn ``turn_ids`` when the env answers with ``messages``: what closes the
        assistant turn (less the eos the model already sampled), the messages, and the next generation prompt."""
        base = self._render(self._probe, tools, generation_prompt=False)
        full = self._render(self._probe + list(messages), tools, generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("chat template is not prefix-stable: appending messages changed earlier text")
        ended = bool(turn_ids) and turn_ids[-1] == self.eos_id
        close = self._close_after_eos if ended else self._close_turn
        # the probe's own close text is part of `base`; the delta starts right after it
        return self._encode(close + full[len(base):])

    def turn_text(self, turn_ids: list[int]) -> str:
        """The model's turn as text for the env (tool-call tags kept, a trailing eos dropped)."""
        ids = turn_ids[:-1] if turn_ids and turn_ids[-1] == self.eos_id else turn_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class TokenEpisode:
    """The growing id sequence of one episode with its per-token loss mask and rollout logprobs."""

    token_ids: list[int]
    prompt_len: int = 0
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> TokenEpisode:
        n = len(prompt_ids)
        return cls(list(prompt_ids), n, [0] * n, [0.0] * n)

    def add_model_turn(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_observation(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.token_ids)
