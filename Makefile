# The two commands of the README:
#   make demo   -> set up .venv, then `paratrain train` (digits CNN, ddp over 2 local processes)
#   make test   -> set up .venv, then ruff, import-linter (layers), mypy, the benchmark claims check
#                  (every figure BENCHMARKS.md quotes against its JSON) and the test suite (not `slow`)
#   make test-all -> the same with the slow tests too
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all lint typecheck bench clean

# `make test` (CI) runs every test not marked `slow`; `make test-all` runs them all (the slow tier repeats what
# the default tier covers at more sizes and options: bf16 of every strategy, longer resharding chains, kill tests).
PYTEST_ARGS ?= -m "not slow"

$(BIN)/paratrain: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/paratrain

setup: $(BIN)/paratrain

demo: setup
	$(BIN)/paratrain train $(ARGS)

# lint and type check first (seconds), then the suite: unit, distributed (2-4 Gloo ranks), end to end
test: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python benchmarks/check_claims.py
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/mypy
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: setup
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
