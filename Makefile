# The README's two commands: `make train` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-test train test test-slow test-all bench gpu-check clean

# What the main job imports, nothing more: `make train` on a fresh clone does not wait for the test extras
# (transformers, wandb and their dependencies: issue 27).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The tested CPU build first: a range admitting 2.14+ would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# The suite adds its extras (pytest, and the oracles of tests/interop/test_hf.py and tests/observe/test_wandb.py).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $(TEST_STAMP)

setup: $(STAMP)
setup-test: $(TEST_STAMP)

# Main job: the default MoE on the default corpus (Shakespeare), multi-process layout, summary + sample.
train: $(STAMP)
	$(VENV)/bin/nanotitan data prepare
	$(VENV)/bin/nanotitan train --config configs/default.toml $(ARGS)

# The test suite without its slow tier (the README's test command; <= 25 min on a 2-core machine).
test: $(TEST_STAMP)
	$(PY) -m pytest -q -rs --durations=15 -m "not slow" $(ARGS)

# The slow tier: the longest multi-process launches (world 8, elastic re-layouts, emulated topologies).
# CI runs it after `make test` (.ci/run); `make test-all` runs both in one session.
test-slow: $(TEST_STAMP)
	$(PY) -m pytest -q -rs --durations=15 -m slow $(ARGS)

test-all: $(TEST_STAMP)
	$(PY) -m pytest -q -rs --durations=15 $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/nanotitan bench dp
	$(VENV)/bin/nanotitan bench pp
	$(VENV)/bin/nanotitan bench ep

# On a CUDA machine: NCCL equivalence (fp32, bf16) and MFU of MID/default, one table (docs/precision.md).
# Skips cleanly without CUDA.
gpu-check: $(TEST_STAMP)
	PYTHON=$(PY) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
