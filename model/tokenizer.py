"""The tokenizer of Marathon's tiny and test models.

No hub access is assumed: the tokenizer is a byte-level BPE trained deterministically (with the `tokenizers`
library that transformers uses) on a small embedded corpus of the text the built-in tasks produce (chat
turns, JSON tool calls, digits, English). It is saved next to every checkpoint, so vLLM and the learner load
the same files. Real-scale runs point ``tokenizer`` in their config at a pretrained tokenizer directory.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen-style ChatML template; tool results come back as role "tool" wrapped in <tool_response>.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant that solves tasks step by step and calls tools when needed.",
    'To call a tool, write <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "the key of document 17"}}</tool_call>',
    '<tool_call>{"name": "read", "arguments": {"doc_id": 17, "offset": 0}}</tool_call>',
    '<tool_call>{"name": "run_python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>',
    "The answer is 42. Final answer: 42",
    "Compute the value of the expression and report the final answer.",
    "Find the secret code stored in the document whose title mentions the river.",
    "error: unknown tool. error: malformed JSON in tool call. result: 1234",
    "Write a file named answer.txt that contains the sorted list of numbers.",
    "+ - * / ( ) = , . : ; ? ! ' \" { } [ ] < > _ # % & @ $ ^ ~ ` |",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 64 99 100 128 256 512 1000 1024",
    "the quick brown fox jumps over the lazy dog while a river flows past the old mill",
    "system user assistant tool name arguments expression query result answer final step",
    "def main(): return x + y  # python code with indentation\n    if value > 0:\n        print(value)",
]


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer. Deterministic: the same corpus and size give the same ids."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(path: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = train_tokenizer(vocab_size)
    tok.save_pretrained(str(path))
    return tok
