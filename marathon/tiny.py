"""Tiny random checkpoints written to disk, for tests, `marathon doctor` and benchmarks (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

from model.tokenizer import save_tokenizer


def write_tiny_qwen3(path: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """A 2-layer random Qwen3 (hidden 128, head_dim 64: the smallest head size vLLM's CPU attention takes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tok = save_tokenizer(path, vocab_size)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path
