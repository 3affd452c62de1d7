# Two commands do all set-up: `make run` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test lint format bench clean chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/moorline serve

# The dashboard's browser test drives Debian's chromium, never a browser Playwright downloads.
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

test: install chromium
	$(BIN)/python -m pytest --cov --cov-report=term $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check moorline tests bench
	$(BIN)/ruff format --check moorline tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff check --fix moorline tests bench
	$(BIN)/ruff format moorline tests bench

bench: install
	$(BIN)/python bench/db_commit.py
	$(BIN)/python bench/enqueue.py
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/metrics_scrape.py
	$(BIN)/python bench/dashboard.py
	$(BIN)/python bench/api.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
