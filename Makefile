# Quick start: `make demo` (set up, then run the Flower app on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The groups' default data directory, so that a plain `flwr run apps/llama_fl_hsdp` finds the prepared corpus.
DATA ?= $(HOME)/.cache/flwr_sharded
# The lowest version of a dependency the package declares in pyproject.toml (`"NAME>=FLOOR"`): the one declaration.
floor = $(shell sed -n 's/^ *"$(1)\(\[[a-z,]*\]\)\{0,1\}>=\([0-9.]*\).*/\2/p' pyproject.toml)
# The CPU wheel this kind of machine keeps on disk (the registry's Linux wheels are CUDA builds of several GB); GPU
# users install their own torch, at least the floor (`make test-floors` runs on the floor itself).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export FLWR_SHARDED_DATA := $(abspath $(DATA))

.PHONY: setup data demo train-demo test test-fast test-slow test-slurm floors-venv test-floors gpu-bundle image-venv \
	gpu-rehearsal plan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,plot]"
	$(BIN)/python -c 'import matplotlib.font_manager'  # its font cache, built once here (it runs fc-list), not in a test
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

# pytest-xdist workers of `make test` and `make test-slow`: most multi-process tests wait on each other's processes
# (Flower polls, rendezvous, round deadlines); the tests of a file that start processes stay in one worker, and those
# that share a machine-wide resource in one (tests/conftest.py: SHARED_RESOURCE). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: setup  ## the whole test suite (CPU, gloo)
	$(BIN)/python -m pytest -q $(XDIST)

test-fast: setup  ## the tests that start no process (a first answer in under two minutes)
	$(BIN)/python -m pytest -q -m "not dist and not slow" $(XDIST)

test-slow: setup  ## the tests kept out of `make test` for time (marked slow; CI runs them after `make test`)
	FLWR_SHARDED_SLOW_TESTS=1 $(BIN)/python -m pytest -q -m slow $(XDIST)

test-slurm: setup  ## tests/deploy/test_slurm.py on a real single-node Slurm (apt-installs slurm-wlm as root if missing)
	FLWR_SHARDED_SLURM_TESTS=1 $(BIN)/python -m pytest -q tests/deploy/test_slurm.py

# Virtualenvs that outlive a clone (CI's fresh clone finds them): each is rebuilt only when what it is built from
# changes (the Python, the pip arguments, the files named), so a second run installs nothing.
VENVS ?= $(HOME)/.cache/flwr_sharded/venvs
# $(call cached_venv,DIR,PYTHON,PIP ARGS,FILES[,AFTER]): DIR, a virtualenv of PYTHON with `pip install PIP ARGS` (then
# the command AFTER), unless DIR/spec records the same Python, arguments and FILES' contents.
define cached_venv
	@spec="$$($(2) -V 2>&1) | $(3) | $$(cat $(4) | sha256sum | cut -c1-16)"; \
	if [ "$$(cat $(1)/spec 2>/dev/null)" = "$$spec" ]; then echo "$(1): up to date, nothing installed"; else \
		echo "$(1): building ($$spec)" && rm -rf $(1) && $(2) -m venv $(1) && \
		$(1)/bin/pip install --quiet --upgrade pip && $(1)/bin/pip install --quiet $(3) $(if $(5),&& $(5)) && \
		echo "$$spec" > $(1)/spec; fi
endef

# The floors proven: a venv of their own with torch, transformers and flwr at their floors (the rest as pip resolves
# them; the package itself from this tree, on PYTHONPATH), the in-process tests of training/ and parallel/, and a few
# that start processes: the meta-device build and init (tied weights, rotary buffers), a sync of 2 groups (the
# all-gather), the quantized ring on 2 ranks, a checkpoint and its resume, an NCCL-style federation group's
# registration. The torch wheels of the registry are CUDA builds: they run here on the CPU.
FLOORS_VENV ?= $(VENVS)/floors
FLOORS := torch==$(call floor,torch) transformers==$(call floor,transformers) flwr[simulation]==$(call floor,flwr)
RING_TEST := test_quantized_all_reduce_is_the_sum_within_its_roundings_bit_identical_and_sends_a_quarter
FLOOR_TESTS := tests/training/test_model_init.py \
	"tests/parallel/test_sync.py::test_fl_fsdp_sync_is_token_weighted_average[67108864]" \
	"tests/parallel/test_ring.py::$(RING_TEST)[2]" \
	"tests/training/test_checkpoint.py::test_resume_continues_the_same_run[sync-write]" \
	"tests/parallel/test_collectives.py::test_every_process_group_has_the_configured_timeout[mesh]" \
	tests/flower/test_rendezvous_groups.py

floors-venv:
	$(call cached_venv,$(FLOORS_VENV),$(PYTHON),$(foreach spec,$(FLOORS),"$(spec)") ".[dev]",pyproject.toml,\
		$(FLOORS_VENV)/bin/pip uninstall --quiet --yes flwr_sharded)

test-floors: floors-venv  ## the tests that prove pyproject.toml's floors, on the floors (~80 s; ~3 min the first time)
	$(FLOORS_VENV)/bin/python -c 'import sys; from importlib.metadata import version; \
		from packaging.requirements import Requirement; \
		bad = [f"{r.name} {version(r.name)}" for r in map(Requirement, sys.argv[1:]) \
		       if not r.specifier.contains(version(r.name))]; \
		sys.exit(f"not the floors: {bad}") if bad else print("on the floors:", *sys.argv[1:])' $(FLOORS)
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-m "not dist and not slow" tests/training tests/parallel
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

# The GPU check on the lent machine's image as it is (Python 3.12, its torch and transformers, no flwr, ray or
# datasets): `make gpu-bundle` writes build/gpu-bundle (the wheels the check needs that the image lacks, for CPython
# 3.12 on x86-64 Linux, and the prepared corpus) and prints the one command that runs the check there;
# `make gpu-rehearsal` runs that command with --dry in a virtualenv that mirrors the image.
GPU_BUNDLE := build/gpu-bundle
GPU_BUNDLE_MIB := 40
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any
# The image's Python where this machine has one (python3.12, or pyenv's), else $(PYTHON): the rehearsal says which.
IMAGE_PYTHON ?= $(or $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; print(sys.executable)' 2>/dev/null && break; done),$(PYTHON))
IMAGE_VENV ?= $(VENVS)/gpu-image

gpu-bundle: setup  ## the wheels and corpus the GPU check carries to the lent machine, and the command that runs it
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/wheels $(GPU_BUNDLE)/data
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,$(GPU_WHEEL_PLATFORMS),--platform $(p)) -d $(GPU_BUNDLE)/wheels -r benchmarks/gpu_bundle/requirements.txt
	cp -r $(DATA)/tokenizer $(DATA)/shakespeare $(GPU_BUNDLE)/data/
	cp benchmarks/gpu_bundle/run_check.sh $(GPU_BUNDLE)/
	@ls $(GPU_BUNDLE)/wheels; size=$$(du -sm $(GPU_BUNDLE) | cut -f1); echo "$(GPU_BUNDLE): $$size MiB"; \
		[ $$size -lt $(GPU_BUNDLE_MIB) ] || { echo "over $(GPU_BUNDLE_MIB) MiB" >&2; exit 1; }
	@echo "On the GPU machine, from the repository root (carry $(GPU_BUNDLE)):"
	@echo "    bash $(GPU_BUNDLE)/run_check.sh"

image-venv:
	$(call cached_venv,$(IMAGE_VENV),$(IMAGE_PYTHON),-r benchmarks/gpu_bundle/image.txt,benchmarks/gpu_bundle/image.txt)

gpu-rehearsal: gpu-bundle image-venv  ## the GPU check's --dry run on a CPU copy of the lent image, with the bundle
	@echo "the image's Python here: $$($(IMAGE_VENV)/bin/python -V) ($(IMAGE_PYTHON))"
	PYTHON=$(IMAGE_VENV)/bin/python bash $(GPU_BUNDLE)/run_check.sh --dry --out $(CURDIR)/build/gpu-rehearsal

plan: setup  ## what the planner recommends for the paper's cluster
	$(BIN)/flwr-sharded plan --cluster examples/clusters/leonardo.yaml --model llama3.1-8b

clean:  ## remove the virtualenv, caches and outputs (the prepared corpus and the venvs in $(VENVS) stay)
	rm -rf $(VENV) build outputs .pytest_cache
