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

.PHONY: venv sweep study test bench gpu-check gpu-profile lint clean

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

# Every benchmark records its claims in benchmarks/results/ (commit them); the README's
# performance table is then rendered from those files.
bench: venv
	$(PY) benchmarks/quantize.py --record
	$(PY) benchmarks/train_step.py --preset cpu --repeat 3 --record
	$(PY) benchmarks/train_step.py --preset host --steps 40 --repeat 3 --record
	$(PY) benchmarks/optimizer_step.py --preset cpu --record
	$(PY) benchmarks/sweep_overhead.py --record
	$(PY) benchmarks/warm_trial.py --record
	$(PY) benchmarks/compile_step.py --record
	$(PY) benchmarks/node_headers.py --record
	$(PY) benchmarks/record.py

# On a GPU machine, with whatever Python has torch there (`make gpu-check GPU_PY=python3`; no Ray
# needed, but pydantic is, which the GPU machines' image lacks: docs/design.md, "GPU runs", says how
# a lease brings it; the checkout goes on PYTHONPATH, so nothing is installed): the CUDA tests, the
# gpu preset's step (bf16, e4m3 and e4m3 with its diagnostics every step, the step a sweep trial
# takes by default; not the other variants: each is a step graph to compile, the slow part there),
# and four trainers sharing the GPU against one alone (docs/design.md, "GPU runs", has what such
# runs took). Compiling is what takes long there, so every step graph the timed runs need compiles
# cold at once, beside the tests: each variant in a process of its own, and the sharing benchmark's
# one-thread trainers in one more (from the benchmark's cache alone they did not finish in a
# lease), each a run of one step whose timings are thrown away. The timed runs then load their
# graphs from that cache, alone on the machine. `make gpu-profile`, a call of its own after it
# (the two did not fit one 10-minute call), profiles the e4m3 step and the diagnostic one side by
# side: how the diagnostics' extra time splits into device and host time, and which functions
# launch the kernels a step still launches one by one (`--callers`).
GPU_PY ?= $(PY)
gpu-check gpu-profile: export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
gpu-check:
	$(GPU_PY) -m pytest tests/test_cuda.py -p no:cacheprovider -n 5 & tests=$$!; \
	$(GPU_PY) benchmarks/train_step.py --preset gpu --variants e4m3 --steps 1 --warmup 1 > /dev/null & e4m3=$$!; \
	$(GPU_PY) benchmarks/gpu_sharing.py --preset gpu --processes 1 --steps 1 --warmup 1 > /dev/null & trial=$$!; \
	$(GPU_PY) benchmarks/train_step.py --preset gpu --variants e4m3+diag --steps 1 --warmup 1 > /dev/null; \
	wait $$e4m3; wait $$trial; wait $$tests
	$(GPU_PY) benchmarks/train_step.py --preset gpu --variants e4m3,e4m3+diag --steps 20
	$(GPU_PY) benchmarks/gpu_sharing.py --preset gpu --steps 20 --warmup 2

gpu-profile:
	$(GPU_PY) benchmarks/step_profile.py --preset gpu --variants e4m3,e4m3+diag --rows 40 --callers 25

lint: venv
	$(PY) -m ruff check altgrad sweeps tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
