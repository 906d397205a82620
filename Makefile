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

# Two pytest workers (pytest-xdist), a test file per worker at a time: most tests use one core, so two share the
# machine's cores; a file's module fixtures (a world running many cases) run once. Tests marked `serial` bound a wall
# time, so they run after, alone. Exit 5 (nothing selected, e.g. ARGS naming one file) is not a failure.
WORKERS ?= 2
PYTEST  := $(PY) -m pytest -q -rs
define two_passes
	$(PYTEST) --durations=15 -n $(WORKERS) --dist loadfile -m "($(1)) and not serial" $(ARGS) || [ $$? -eq 5 ]
	$(PYTEST) --durations=5 -m "($(1)) and serial" $(ARGS) || [ $$? -eq 5 ]
endef

# The test suite without its slow tier (the README's test command; <= 25 min on a 2-core machine).
test: $(TEST_STAMP)
	$(call two_passes,not slow)

# The slow tier: the longest multi-process launches (world 8, elastic re-layouts, emulated topologies).
# CI runs it after `make test` (.ci/run); `make test-all` runs both.
test-slow: $(TEST_STAMP)
	$(call two_passes,slow)

test-all: $(TEST_STAMP)
	$(call two_passes,slow or not slow)

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
