"""Token-level episode encoding: ids only grow, masks mark sampled ids, the text equals the chat template's."""

from __future__ import annotations

import pytest

from model.tokenizer import train_tokenizer
from rollout.chat import ChatCodec, TokenEpisode

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "math", "parameters": {}}}]
OPENING = [
    {"role": "system", "content": "Use the calculator tool, then reply: Final answer: <number>"},
    {"role": "user", "content": "What is 12 * (3 + 4)?"},
]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def codec(tok):
    return ChatCodec(tok)


def test_stop_ids_are_tool_call_end_and_eos(tok, codec):
    assert codec.stop_token_ids == (tok.convert_tokens_to_ids("</tool_call>"), tok.convert_tokens_to_ids("<|im_end|>"))
    with pytest.raises(ValueError, match="no single token"):
        ChatCodec(tok, tool_call_end="</not_a_tag>")


@pytest.mark.parametrize("first_turn_ends_with_eos", [False, True])
def test_episode_ids_are_a_prefix_consistent_concatenation(tok, codec, first_turn_ends_with_eos):
    """Three model turns and two tool answers: the ids are prompt + turn + delta + ..., each model turn exactly as
    sampled (mask 1, its logprobs), each delta mask 0; decoded, the whole equals the template's rendering."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = [codec.eos_id]
    turns = [enc(CALL) + (eos if first_turn_ends_with_eos else []), enc(CALL), enc("Final answer: 84") + eos]
    answers = [[{"role": "tool", "content": "84"}], [{"role": "tool", "content": "error: x"}, {"role": "tool", "content": "84"}]]

    ep = TokenEpisode.start(codec.prompt_ids(OPENING, TOOLS))
    expected, mask, snapshots = list(ep.token_ids), [0] * len(ep), []
    for i, turn in enumerate(turns):
        lps = [-0.5 - j for j in range(len(turn))]
        snapshots.append(list(ep.token_ids))
        ep.add_model_turn(turn, lps)
        expected += turn
        mask += [1] * len(turn)
        if i < len(answers):
            delta = codec.observation_ids(turn, answers[i], TOOLS)
            ep.add_observation(delta)
            expected += delta
            mask += [0] * len(delta)
    assert ep.token_ids == expected and ep.loss_mask == mask
    for snap in snapshots:  # earlier states are prefixes: nothing was re-tokenized
        assert ep.token_ids[: len(snap)] == snap
    assert [lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m == 0] == [0.0] * (len(ep) - sum(mask))
    assert sum(lp != 0.0 for lp in ep.logprobs) == sum(len(t) for t in turns)
    assert ep.prompt_len == len(codec.prompt_ids(OPENING, TOOLS))

    conversation = list(OPENING)
    for i, turn in enumerate(turns):
        conversation.append({"role": "assistant", "content": codec.turn_text(turn)})
        conversation += answers[i] if i < len(answers) else []
    rendered = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    # the last turn ended with eos; the template adds the newline after it that the next turn would bring
    assert tok.decode(ep.token_ids) == rendered.removesuffix("\n")


def test_observation_closes_an_unfinished_turn(tok, codec):
    """A turn stopped at </tool_call> (no eos) gets the template's close text; one that sampled eos does not
    get a second eos."""
    turn = tok.encode(CALL, add_special_tokens=False)
    msgs = [{"role": "tool", "content": "84"}]
    open_delta = codec.observation_ids(turn, msgs)
    closed_delta = codec.observation_ids(turn + [codec.eos_id], msgs)
    assert open_delta[0] == codec.eos_id and open_delta[1:] == closed_delta
    assert tok.decode(closed_delta).startswith("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>")
    assert tok.decode(closed_delta).endswith("<|im_start|>assistant\n")


def test_turn_text_keeps_tool_tags_and_drops_eos(tok, codec):
    turn = tok.encode(CALL, add_special_tokens=False) + [codec.eos_id]
    assert codec.turn_text(turn) == CALL


def test_mismatched_logprobs_are_rejected():
    ep = TokenEpisode.start([1, 2, 3])
    with pytest.raises(ValueError, match="logprobs"):
        ep.add_model_turn([4, 5], [-1.0])
