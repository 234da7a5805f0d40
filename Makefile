# Quick start: `make demo` and `make test` each create .venv and install what they need.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

# The main job on its embedded default: plan a profile-B global batch on PP=4 x DP=2, compare
# with stock Megatron's 1F1B, and draw both timelines.
demo: $(STAMP)
	mkdir -p out
	$(BIN)/chunkflow plan --profile B --num-sequences 2000 --chunk-size 8192 --k 1 \
		--pp 4 --dp 2 --png out/plan.png

test: $(STAMP)
	$(BIN)/python -m pytest tests -m "not gpu" -q

bench: $(STAMP)
	$(BIN)/python scripts/benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
