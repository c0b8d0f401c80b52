"""A randomly initialised Marathon model of a named preset, with the tokenizer written to its checkpoint dir."""

from __future__ import annotations

from pathlib import Path

import torch

from model.config import MarathonConfig
from model.modeling import MarathonForCausalLM
from model.tokenizer import save_tokenizer


def random_model(path: str | Path, preset: str = "tiny", seed: int = 0, vocab_size: int = 512,
                 **overrides) -> MarathonForCausalLM:
    """Writes the tokenizer to ``path`` and returns a fresh model (init seeded with ``seed``) whose special-token
    ids match it; ``model.save_pretrained(path)`` completes the checkpoint."""
    tok = save_tokenizer(path, vocab_size)
    config = MarathonConfig.from_preset(
        preset, vocab_size=vocab_size, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides
    )
    torch.manual_seed(seed)
    return MarathonForCausalLM(config)
