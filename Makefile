# Two commands do all set-up: `make run` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: serving needs the package and its drivers (`.[all]`); the tests and linters
# (`dev`: pytest, mypy, Playwright, ...) only `make test`, `make lint` and the rest. STAMP keeps
# its old name for the full install, so a venv made before the split stays current.
STAMP := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.installed-run-stamp
PYTEST_ARGS ?=

.PHONY: install run test test-full test-schedules-drill test-bulk-full fuzz lint format bench bench-retention bench-scale soak clean chromium pgbouncer netns redis-sentinel

# constraints.txt: the tested versions (see its header), so CI and users install those.
$(RUN_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all]'
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

# A venv with the full install serves as it is; otherwise only what serving needs.
run: $(if $(wildcard $(STAMP)),$(STAMP),$(RUN_STAMP))
	$(BIN)/moorline serve

# The dashboard's browser test drives Debian's chromium, never a browser Playwright downloads.
chromium:
	@test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

# The contract suite also runs through Debian's pgbouncer (tests/pgbouncer.py starts its own).
pgbouncer:
	@test -x /usr/sbin/pgbouncer || (apt-get update && apt-get install -y pgbouncer)
# The partition test (tests/faults/test_partitions.py) builds network namespaces with `ip` and
# injects faults with `iptables`, both from Debian.
netns:
	@(command -v ip && command -v iptables) >/dev/null || \
		(apt-get update && apt-get install -y iproute2 iptables)
# The Sentinel and Cluster tests (tests/redis_topologies.py) start Debian's redis-sentinel
# beside redis-server and redis-cli, on ports of their own.
redis-sentinel:
	@test -x /usr/bin/redis-sentinel || (apt-get update && apt-get install -y redis-sentinel)

# compileall: with PYTHONDONTWRITEBYTECODE set (as on these machines) Python never caches
# bytecode, so each `moorline` process the suite starts (workers, servers, CLI calls: many
# dozens) would compile the package from source again, about 0.3 s of CPU each; the .pyc
# files written here are read by all of them (the variable only stops Python writing them).
# Test modules run in TEST_PROCESSES processes (pytest-xdist, a module's tests in one process,
# each module on databases and Redis prefixes of its own): most tests wait on other processes
# (servers, workers, leases), so three processes on two cores take about half the time of one.
TEST_PROCESSES ?= 3
test: install chromium pgbouncer netns redis-sentinel
	$(BIN)/python -m compileall -q moorline tests
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile --cov --cov-report=term \
		$(PYTEST_ARGS)

# The fault and property tests at the issues' full size (CI runs them smaller): about an hour.
test-full: install chromium pgbouncer netns redis-sentinel
	$(BIN)/python -m compileall -q moorline tests
	MOORLINE_FULL=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Issue 20's schedules drill: 3 API processes and 2 workers for 3 minutes on each backend, the
# scheduler's leader killed twice; every tick must run exactly once (part of test-full too).
test-schedules-drill: install
	MOORLINE_FULL=1 $(BIN)/python -m pytest tests/faults/test_schedule_faults.py --timeout=900 \
		$(PYTEST_ARGS)

# Retry, re-run and bulk jobs at the issue's size: bulk retries of 10,000 failed runs, sent
# twice and with their processor killed mid-job (kill -9), on every backend: a few minutes.
test-bulk-full: install
	MOORLINE_FULL=1 $(BIN)/python -m pytest tests/engine/test_retry.py tests/api/test_bulk.py \
		tests/faults/test_bulk_faults.py --durations=0 $(PYTEST_ARGS)

# Schemathesis against a live `moorline serve` with tenant and admin credentials, every operation
# of the served OpenAPI document: no 5xx, every answer as documented. `make test` runs the same
# test with 15 examples an operation; FUZZ_EXAMPLES sets it here.
FUZZ_EXAMPLES ?= 1000
fuzz: install
	MOORLINE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/api/test_server.py \
		-k every_operation -s --timeout=0 $(PYTEST_ARGS)

# Commit subjects stay within 72 characters (what `git log --oneline` and mail show), checked
# from the last commit that landed before the rule; outside a git checkout there is nothing to check.
SUBJECTS_SINCE := 4b4eb48
lint: install
	@git log --format=%s $(SUBJECTS_SINCE)..HEAD 2>/dev/null | awk 'length > 72 \
		{ print "commit subject over 72 characters: " $$0; bad = 1 } END { exit bad }'
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
	$(BIN)/python bench/metrics_scrape.py
	$(BIN)/python bench/dashboard.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/client_cpu.py --sync
	$(BIN)/python bench/latency.py

# Retention at the issue's full size: 1,000,000 old runs deleted on SQLite and PostgreSQL while
# a drain runs beside the cleaner (bench/retention.py; its default is 50,000 runs).
bench-retention: install
	PYTHONPATH=. $(BIN)/python bench/retention.py --full --finish $(BENCH_ARGS)

# The scaling curve (issue 22): drain rate with 1-8 `moorline worker` processes per backend
# (bench/scale.py; 2,000 runs per drain took about 4 minutes on a quiet 2-core machine, 16-18
# on a loaded one; the default is 4,000); BENCH_ARGS e.g. "--backends postgresql --runs 2000".
bench-scale: install
	PYTHONPATH=. $(BIN)/python bench/scale.py $(BENCH_ARGS)

# The chaos soak at full size (PostgreSQL + Redis, real processes, faults); `make soak MINUTES=60`.
# The CI-sized version is tests/soak (about two and a half minutes, part of `make test`).
MINUTES ?= 10
soak: install
	$(BIN)/python -m tests.soak --minutes $(MINUTES)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
