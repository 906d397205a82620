# The README's two commands: `make train` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-fast bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The tested CPU build first: a range admitting 2.14+ would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# Main job: the default MoE on the default corpus (Shakespeare), multi-process layout, summary + sample.
train: $(STAMP)
	$(VENV)/bin/nanotitan data prepare
	$(VENV)/bin/nanotitan train --config configs/default.toml $(ARGS)

# The whole test suite (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=15 $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/nanotitan bench dp
	$(VENV)/bin/nanotitan bench pp
	$(VENV)/bin/nanotitan bench ep

# On a CUDA machine: NCCL equivalence (fp32, bf16) and MFU of MID/default, one table (docs/precision.md).
# Skips cleanly without CUDA.
gpu-check: $(STAMP)
	PYTHON=$(PY) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
