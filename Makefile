# kvretain: `make verify` (main job) and `make test` set themselves up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvretain-installed
# --no-compile: pip would byte-compile every file of torch, vLLM and Ray (most of set-up's
# time); Python compiles, and caches, only the modules a run imports.
PIP    := $(BIN)/python -m pip install -q --no-compile
HYPOTHESIS_PROFILE ?= ci
export HYPOTHESIS_PROFILE

.PHONY: setup verify test release-envs lint gpu-check matrix clean

$(STAMP): pyproject.toml requirements/dev.txt requirements/ray.txt $(wildcard requirements/vllm*.txt) $(wildcard requirements/sglang*.txt)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -r requirements/dev.txt -r requirements/ray.txt
	@if [ -f requirements/vllm.txt ]; then \
	  $(PIP) -r requirements/vllm.txt && \
	  $(PIP) --no-deps -r requirements/vllm-nodeps.txt || \
	  echo "note: vLLM could not be installed; the vllm target will be reported as skipped"; \
	fi
	@if [ -f requirements/sglang-nodeps.txt ]; then \
	  $(PIP) --no-deps -r requirements/sglang-nodeps.txt || \
	  echo "note: SGLang could not be installed; the sglang target will be reported as skipped"; \
	fi
	$(PIP) --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)
	@echo "kvretain is installed in $(BIN), not on your PATH: run '. $(BIN)/activate' once per shell, or call $(BIN)/kvretain"

verify: setup
	$(BIN)/kvretain verify --require vllm --require sglang

# The older vLLM release whose cached environment (~/.cache/kvretain, the matrix's
# builder) `make test` installs, so the tests that run a real older release run:
# 0.23.0 predates three profile switches (tests/test_release_profile.py) and is one
# the adapter and capability tests read. About 0.6 GB and 30-60 s, once. Add releases
# with `make test TEST_RELEASES="0.23.0 0.25.0"`.
TEST_RELEASES ?= 0.23.0

# A failed install fails CI (CI set, not false/0); elsewhere those tests skip with the reason.
release-envs: setup
	@$(BIN)/python -m invariants.targets.vllm_env $(TEST_RELEASES) || \
	case "$${CI:-}" in \
	  ""|0|false) echo "note: the tests that need vLLM $(TEST_RELEASES) will be skipped" >&2 ;; \
	  *) echo "release-envs: CI needs vLLM $(TEST_RELEASES) installed (see the line above)" >&2; exit 1 ;; \
	esac

# The suite runs in TEST_WORKERS processes (pytest-xdist; auto: one per core; 0: this one),
# a whole test file to a worker so each module's fixtures are built once per worker; it
# prints every skip's reason (pyproject's -r) and the 15 slowest tests.
# xdist queues the files most tests first (its --loadscope-reorder default) and gives a worker the
# next when it has two tests left: here the two workers end within seconds of each other (2.0 s,
# quiet, 2026-12-06), so queueing the slowest files first has nothing to take (simulated on a
# per-test profile: under 1 s). The wall is the tests' own work: about 920 s of CPU, 38% of it in
# the processes tests start (each that imports vLLM pays ~7.6 s); CPU 174% of the 2 cores.
# tests/test_suite_count.py fails the run if it collects fewer tests than tests/data/suite_floor.txt.
TEST_WORKERS ?= auto

# KVRETAIN_TEST_RELEASES tells the tests which release environments must be there.
# PYTHONDONTWRITEBYTECODE is cleared so the project's bytecode is cached after the first of the
# many processes the suite starts (a machine that sets it recompiles every file in each: ~9 s).
test: setup release-envs
	PYTHONDONTWRITEBYTECODE= KVRETAIN_TEST_RELEASES="$(TEST_RELEASES)" $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

LINTED := model reference_impl invariants gpu_check tests

lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy model reference_impl invariants gpu_check

gpu-check: setup
	$(BIN)/kvretain gpu-check --device $$($(BIN)/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")

# Every vLLM release from 0.21.0 to the newest on the index, each in a cached
# environment under ~/.cache/kvretain (about 0.6-0.9 GB and 1-2 min to install per release);
# then the identity-field table (docs/identity-matrix.md), probed on every installed release.
matrix: setup
	$(BIN)/kvretain matrix --json matrix-report.json --markdown matrix-report.md
	$(BIN)/kvretain matrix --identity-table --identity-probe

clean:
	rm -rf $(VENV) kvretain-traces .hypothesis build *.egg-info

# Opt-in: the hot pure modules (invariants.compiled.COMPILED) compiled with mypyc into build/mypyc
# (git-ignored; never beside the sources), about 1-2 min. kvretain uses the build while every
# compiled source matches it (a stale one is ignored with a warning); KVRETAIN_PURE_PYTHON=1 opts out,
# and the test suite runs pure Python. `kvretain bench --compare-compiled` says whether it pays.
.PHONY: compiled
compiled: setup
	KVRETAIN_PURE_PYTHON=1 $(BIN)/python -m invariants.native.build
