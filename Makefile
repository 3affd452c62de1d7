# Two commands do all set-up: `make run` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test lint format bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/moorline serve

test: install
	$(BIN)/python -m pytest --cov --cov-report=term $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check moorline tests bench
	$(BIN)/ruff format --check moorline tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff check --fix moorline tests bench
	$(BIN)/ruff format moorline tests bench

# The report suite (bench-report.md/.json); BENCH_ARGS e.g. "--quick --backends sqlite".
# bench/db_commit.py and bench/enqueue.py are one-off comparisons, run by hand.
BENCH_ARGS ?=
bench: install
	$(BIN)/moorline bench $(BENCH_ARGS)

# The chaos soak at full size (PostgreSQL + Redis, real processes, faults); `make soak MINUTES=60`.
# The CI-sized version is tests/soak (about two minutes, part of `make test`).
MINUTES ?= 10
soak: install
	$(BIN)/python -m tests.soak --minutes $(MINUTES)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
