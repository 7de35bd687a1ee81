# Quick start: `make demo` (set up, then run the Flower app on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The groups' default data directory, so that a plain `flwr run apps/llama_fl_hsdp` finds the prepared corpus.
DATA ?= $(HOME)/.cache/flwr_sharded
# CPU wheel for this kind of machine; GPU users install their own torch (the package asks for torch>=2.6).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export FLWR_SHARDED_DATA := $(abspath $(DATA))

.PHONY: setup data demo train-demo test test-fast test-slow plan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,plot]"
	touch $@

$(DATA)/tokenizer/tokenizer.json: | $(VENV)/.installed
	$(BIN)/flwr-sharded prepare-data --data-dir $(DATA)

data: $(DATA)/tokenizer/tokenizer.json  ## fetch the embedded corpus and train its tokenizer (offline afterwards)

setup: $(VENV)/.installed data  ## the virtualenv with the package and its test/plot extras, and the prepared corpus

demo: setup  ## the main job: `flwr run apps/llama_fl_hsdp --stream` in local simulation (2 groups x 2 ranks)
	PATH=$(abspath $(BIN)):$$PATH apps/llama_fl_hsdp/run_simulation.sh

train-demo: setup  ## the static engine: FL+FSDP on 4 local ranks, small Llama, 100 steps
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 4 -m flwr_sharded.train --config configs/local/fl-fsdp.yaml \
		--steps 100

test: setup  ## the whole test suite (CPU, gloo)
	$(BIN)/python -m pytest -q

test-fast: setup  ## the tests that start no process (a first answer in under two minutes)
	$(BIN)/python -m pytest -q -m "not dist and not slow"

test-slow: setup  ## the tests kept out of `make test` for time (marked slow; CI runs them after `make test`)
	FLWR_SHARDED_SLOW_TESTS=1 $(BIN)/python -m pytest -q -m slow

plan: setup  ## what the planner recommends for the paper's cluster
	$(BIN)/flwr-sharded plan --cluster examples/clusters/leonardo.yaml --model llama3.1-8b

clean:  ## remove the virtualenv, caches and outputs (the prepared corpus in $(DATA) stays)
	rm -rf $(VENV) outputs .pytest_cache
