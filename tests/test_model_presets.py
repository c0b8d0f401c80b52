"""Real-scale presets, built on the meta device (no memory): layouts and total vs activated parameters."""

from __future__ import annotations

import pytest
import torch

from model import MarathonConfig, MarathonForCausalLM


def meta_model(name: str) -> MarathonForCausalLM:
    with torch.device("meta"):
        return MarathonForCausalLM(MarathonConfig.from_preset(name))


def test_kimi_linear_48b_a3b_shapes():
    model = meta_model("kimi-linear-48b-a3b")
    counts = model.parameter_counts()
    assert 46e9 < counts["total"] < 51e9  # "48B"
    assert 2.5e9 < counts["activated"] - counts["embeddings"] < 3.5e9  # "A3B" (non-embedding)
    kinds = model.config.layer_kinds
    assert kinds.count("G") == 7 and kinds.count("L") == 20 and kinds[3] == kinds[-1] == "G"


def test_marathon_93_layer_896_expert_shapes():
    model = meta_model("marathon-93l-896e")
    cfg = model.config
    assert cfg.layer_kinds.count("L") == 69 and cfg.layer_kinds.count("G") == 24
    moe = model.model.moe_layers[0]
    assert moe.experts.gate_up_proj.shape[0] == 896 and cfg.num_experts_per_tok == 16 and cfg.n_shared_experts == 2
    counts = model.parameter_counts()
    assert counts["total"] > 20 * counts["activated"]  # very sparse: 16 of 896 experts per token
    assert 700e9 < counts["total"] < 900e9 and 15e9 < counts["activated"] < 30e9


def test_tiny_preset_fits_vllm_cpu_head_dims():
    cfg = MarathonConfig.from_preset("tiny")
    assert cfg.head_dim == 64 and cfg.linear_head_k_dim == cfg.linear_head_v_dim == 64
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim == 64 and cfg.v_head_dim == 64 and cfg.vocab_size == 512


def test_bad_layout_is_rejected():
    with pytest.raises(ValueError, match="layer_layout"):
        MarathonConfig(layer_layout="LXG")
