"""Tiny random `MarathonForCausalLM` checkpoints (safetensors + tokenizer) for the plugin's tests and parity bench.

Beyond the default init, the balancing buffers (expert_scale / expert_bias), the attention-residual queries
and the norm weights are randomised, so parity checks exercise every parameter the server must reproduce
(at init they are ones / zeros and would hide a mis-mapped tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.random_init import random_model


def write_tiny_marathon(path: str | Path, seed: int = 0, vocab_size: int = 512, **overrides) -> Path:
    """Writes the "tiny" preset (overridable, e.g. ``layer_layout="L"``) to ``path``; returns ``path``."""
    path = Path(path)
    model = random_model(path, "tiny", seed, vocab_size, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("expert_scale"):
                t.copy_(torch.empty_like(t).uniform_(0.5, 2.0, generator=gen))
            elif name.endswith("expert_bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith(".query"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
    model.save_pretrained(path)
    return path


def write_perturbed(src: str | Path, dst: str | Path, seed: int = 5, scale: float = 0.05):
    """The checkpoint at ``src`` with every float tensor moved by ``scale`` of its std (Gaussian), saved to
    ``dst``: "new weights" for in-place update tests. Returns the perturbed HF model (fp32, eval)."""
    from model.modeling import MarathonForCausalLM

    model = MarathonForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(scale * t.std().nan_to_num(0.0) * torch.randn(t.shape, generator=gen))
    model.save_pretrained(dst)
    return model
