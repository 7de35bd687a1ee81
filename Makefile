# Quick start: `make demo` (set up, then run the Flower app on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The groups' default data directory, so that a plain `flwr run apps/llama_fl_hsdp` finds the prepared corpus.
DATA ?= $(HOME)/.cache/flwr_sharded
# The lowest version of a dependency the package declares in pyproject.toml (`"NAME>=FLOOR"`): the one declaration.
floor = $(shell sed -n 's/^ *"$(1)\(\[[a-z,]*\]\)\{0,1\}>=\([0-9.]*\).*/\2/p' pyproject.toml)
# CPU wheel for this kind of machine, torch's floor; GPU users install their own torch (at least the floor).
TORCH_SPEC ?= torch==$(call floor,torch)
BIN := $(VENV)/bin
export FLWR_SHARDED_DATA := $(abspath $(DATA))

.PHONY: setup data demo train-demo test test-fast test-slow test-floors plan clean

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

# The floors proven: a venv of their own with torch, transformers and flwr at their floors (the rest as pip resolves
# them), the in-process tests of training/ and parallel/, and a few that start processes: the meta-device build and
# init (tied weights, rotary buffers), a sync of 2 groups (all_gather_single), the quantized ring on 2 ranks, a
# checkpoint and its resume. About 7.5 min on 2 cores at a load of 5-14 (3.7 of them installing), less when idle.
FLOORS_VENV ?= .venv-floors
FLOORS := torch==$(call floor,torch) transformers==$(call floor,transformers) flwr[simulation]==$(call floor,flwr)
RING_TEST := test_quantized_all_reduce_is_the_sum_within_its_roundings_bit_identical_and_sends_a_quarter
FLOOR_TESTS := tests/training/test_model_init.py \
	"tests/parallel/test_sync.py::test_fl_fsdp_sync_is_token_weighted_average[67108864]" \
	"tests/parallel/test_quantize.py::$(RING_TEST)[2]" \
	"tests/training/test_checkpoint.py::test_resume_continues_the_same_run[sync-write]"

$(FLOORS_VENV)/.installed: pyproject.toml Makefile
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/pip install --quiet $(foreach spec,$(FLOORS),"$(spec)") -e ".[dev]"
	touch $@

test-floors: $(FLOORS_VENV)/.installed  ## the tests that prove pyproject.toml's floors, on the floors (~5-7 min)
	$(FLOORS_VENV)/bin/python -c 'import sys; from importlib.metadata import version; \
		from packaging.requirements import Requirement; \
		bad = [f"{r.name} {version(r.name)}" for r in map(Requirement, sys.argv[1:]) \
		       if not r.specifier.contains(version(r.name))]; \
		sys.exit(f"not the floors: {bad}") if bad else print("on the floors:", *sys.argv[1:])' $(FLOORS)
	OMP_NUM_THREADS=1 $(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not dist and not slow" \
		tests/training tests/parallel
	OMP_NUM_THREADS=1 $(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

plan: setup  ## what the planner recommends for the paper's cluster
	$(BIN)/flwr-sharded plan --cluster examples/clusters/leonardo.yaml --model llama3.1-8b

clean:  ## remove the virtualenv, caches and outputs (the prepared corpus in $(DATA) stays)
	rm -rf $(VENV) $(FLOORS_VENV) outputs .pytest_cache
