#!/usr/bin/env bash
# One device call: GPU tests, then `marathon bench kernels` (extra args pass through), results under $OUT.
# Run from the repo root on the GPU machine with .whl/ carried (fla-core wheel for the comparison).
set -o pipefail
OUT=${OUT:-benchmarks/kernels}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -m gpu tests/test_kernels_gpu.py 2>&1 | tee "$OUT/pytest.log"
python3 -m marathon.commands.bench_kernels --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
