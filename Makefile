# Two commands run everything: `make sweep` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs what it needs (torch==2.13.0 first, so that
# pip never pulls the multi-GB CUDA build on a CPU machine).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SHARED ?= $(abspath ../shared)
export TIKTOKEN_CACHE_DIR ?= $(SHARED)/data/tiktoken_cache
export WANDB_MODE ?= offline
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: venv sweep study test bench lint clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

venv: $(VENV)/.installed

sweep: venv
	$(PY) sweeps/format_ablation.py $(ARGS)

# The CPU study (<= 30 min on 2 cores), its report, and the README's Results section from it.
study: venv
	$(PY) sweeps/format_ablation.py --config sweeps/configs/cpu_study.yaml $(ARGS)
	$(PY) sweeps/publish_study.py experiments/cpu_study

test: venv
	$(PY) -m pytest $(ARGS)

bench: venv
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/train_step.py

lint: venv
	$(PY) -m ruff check altgrad sweeps tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
