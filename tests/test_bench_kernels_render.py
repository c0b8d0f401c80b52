"""`marathon bench kernels --render-only ... --checks-json ...` rebuilds the committed kernel results (no GPU):
the timings of one device run merged with the checks of a --checks-only run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from marathon.commands import bench_kernels

KERNELS = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"


def test_render_only_merges_checks_into_the_committed_results(tmp_path):
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    args = parser.parse_args(["--render-only", str(KERNELS / "logs" / "results_run9.json"),
                              "--checks-json", str(KERNELS / "logs" / "checks_run10.json"), "--out", str(tmp_path)])
    assert bench_kernels.main(args) == 0
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads((KERNELS / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    assert md == (KERNELS / "results.md").read_text()
    assert "; checks: `marathon bench kernels --checks-only" in md
    assert "| 262144 | fp32 |" in md and "| 1048576 | - | not checked" in md
    assert (tmp_path / "kernels.png").stat().st_size > 0


def test_shape_table_puts_a_failed_method_in_its_own_cell():
    """Ours alone (``--method ours``) with a shape out of shared memory: the error shows once, in ours' fwd+bwd
    cell; fla's cells and the ratios stay empty (call 4 of the fourth H200 lease printed the error in the ratios)."""
    rows = [{"B": 1, "T": 32768, "H": 8, "D": 256, "dtype": "fp32", "packed": 0, "ours_fwd_ms": 16.94,
             "ours_error": "OutOfResources: out of resource: shared memory"},
            {"B": 1, "T": 65536, "H": 16, "D": 128, "dtype": "bf16", "packed": 14, "ours_fwd_ms": 7.15,
             "ours_fwd_bwd_ms": 19.52, "fla_fwd_ms": 3.22, "fla_fwd_bwd_ms": 15.41, "ours_over_fla_fwd": 0.45,
             "ours_over_fla_fwd_bwd": 0.79}]
    md = bench_kernels._shapes_markdown({"device": "H200", "fla": "0.6.0", "command": "c"}, rows).splitlines()
    assert md[-2] == "| 1 | 32768 | 8 | 256 | fp32 |  | 16.94 |  |  | OutOfResources: out of resource: shared  |  |  |"
    assert md[-1] == "| 1 | 65536 | 16 | 128 | bf16 | 14 | 7.15 | 3.22 | 0.45 | 19.52 | 15.41 | 0.79 |"


def test_warm_shards_split_every_autotuner_configs_between_processes(monkeypatch):
    """N warm processes (``--warm-shard J/N``) compile every config of a kernel between them, each a disjoint share,
    one config each where there are fewer configs than processes."""
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.prune_configs  # each setattr below is undone after the test

    @triton.autotune(configs=[triton.Config({"B": b}) for b in (1, 2, 4, 8, 16)], key=["n"])
    @triton.jit
    def kernel(x, n, B: tl.constexpr):
        pass

    shares = []
    for j in range(3):
        monkeypatch.setattr(Autotuner, "prune_configs", original)
        bench_kernels._shard_autotuning(f"{j}/3")
        shares.append([c.kwargs["B"] for c in kernel.prune_configs({})])
    assert shares == [[1, 8], [2, 16], [4]]
    for j in range(7):
        monkeypatch.setattr(Autotuner, "prune_configs", original)
        bench_kernels._shard_autotuning(f"{j}/7")
        assert [c.kwargs["B"] for c in kernel.prune_configs({})] == [(1, 2, 4, 8, 16)[j % 5]]


def test_breakdown_compare_loads_an_earlier_kernels_tree_beside_this_one(tmp_path):
    """``breakdown.py --compare DIR`` imports DIR's kernels/ as kernels_before: its modules use each other, not
    this tree's (before, --compare took one file whose imports reached this tree's package)."""
    import shutil

    from benchmarks.kernels.breakdown import load_before

    import kernels.gated_delta_triton as now

    shutil.copytree(KERNELS.parents[1] / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    init = tmp_path / "kernels" / "gated_delta_triton" / "__init__.py"
    init.write_text(init.read_text() + '\nREVISION = "before"\n')
    before = load_before(tmp_path)
    assert before.REVISION == "before" and not hasattr(now, "REVISION")
    chunk = before.chunk_gated_delta_rule_triton
    assert chunk.__module__ == "kernels_before.gated_delta_triton.chunk"
    assert chunk.__globals__["_output_kernel"].fn.__module__ == "kernels_before.gated_delta_triton.chunk_fwd"
    assert now.chunk_gated_delta_rule_triton.__globals__["_output_kernel"].fn.__module__ == \
        "kernels.gated_delta_triton.chunk_fwd"


def test_tinv_read_in_bf16_adds_little_to_the_gradients_error():
    """benchmarks/kernels/tinv_rounding.py, small: at the kernel bench's gate logits, reading Tinv in bf16 in the
    backward (the state-side and dAkk kernels) changes each gradient by under 1% of the error bf16 inputs cause;
    the value and dh0 gradients not at all (their Tinv reads were 16-bit before too)."""
    from benchmarks.kernels.tinv_rounding import changes, chunk_inputs

    out = changes(chunk_inputs(rows=2, heads=2, head_dim=32, gate_mean=0.0, gate_std=1.0))
    for name, (change, scale) in out.items():
        assert change < 0.01 * scale, (name, change, scale)
        if name in ("dq", "dv", "dh0"):
            assert change == 0, name
    assert out["dgate"][0] > 0  # the dgate path does read Tinv


def test_diagonal_inverse_as_a_product_is_as_accurate_as_substitution():
    """benchmarks/kernels/diag_inverse.py, small: the solve's 16x16 diagonal inverses in fp32 as the product
    (I + N)(I + N^2)(I + N^4)(I + N^8) are within 4x of forward substitution's error against fp64, and both under
    1e-7, for unit keys at the bench's gate logits and where decays are near 1 (Akk's largest blocks)."""
    from benchmarks.kernels.diag_inverse import diagonal_blocks, errors
    from benchmarks.kernels.tinv_rounding import chunk_inputs

    for mean in (0.0, -10.0):
        e = errors(diagonal_blocks(chunk_inputs(rows=2, heads=2, head_dim=64, gate_mean=mean, gate_std=1.0), 1.0))
        assert e["product"] < 1e-7 and e["substitution"] < 1e-7, (mean, e)
        assert e["product"] < 4 * e["substitution"], (mean, e)
