"""model/memory.py's cache formulas against the bytes a real MarathonCache holds after a prefill, and the
`marathon bench memory` table."""

from __future__ import annotations

import pytest
import torch

from model import MarathonCache, MarathonConfig, MarathonForCausalLM
from model.memory import cache_bytes, design_cache_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tokens", [3, 11, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_matches_cache_tensors(tokens, dtype):
    cfg = MarathonConfig.from_preset("tiny", layer_layout="LSGGS", num_hidden_layers=5, sliding_window=8)
    torch.manual_seed(0)
    model = MarathonForCausalLM(cfg).to(dtype).eval()
    cache = MarathonCache(cfg)
    with torch.no_grad():
        model(torch.randint(0, 512, (2, tokens)), past_key_values=cache, use_cache=True)
        model(torch.randint(0, 512, (2, 1)), past_key_values=cache, use_cache=True)
    kv_bytes = torch.finfo(dtype).bits // 8
    assert cache.nbytes() == 2 * cache_bytes(cfg, tokens + 1, kv_bytes)  # batch of 2 sequences
    assert cache.layers[0].recurrent_state.dtype == torch.float32  # linear states stay fp32 in any dtype


def test_design_ordering_at_real_shapes():
    cfg = MarathonConfig.from_preset("kimi-linear-48b-a3b")
    at = {t: design_cache_bytes(cfg, t) for t in (8192, 1 << 20)}
    for d in at.values():
        assert d["MHA"] > d["GQA"] > d["MLA"] > d["hybrid"]
    # linear layers are O(1) in length: 1M tokens costs the 7 MLA layers' latents plus a constant
    growth = at[1 << 20]["hybrid"] - at[8192]["hybrid"]
    assert growth == 7 * ((1 << 20) - 8192) * (512 + 64) * 2


def test_bench_memory_command_writes_table_and_png(tmp_path, capsys):
    from marathon.cli import main

    assert main(["bench", "memory", "--presets", "kimi-linear-48b-a3b", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert "| MHA | 3.4 GiB | 27.0 GiB | 108.0 GiB | 432.0 GiB |" in text
    assert (tmp_path / "cache_bytes.png").stat().st_size > 10_000
    assert "hybrid 20L+7G" in capsys.readouterr().out
