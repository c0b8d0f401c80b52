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
