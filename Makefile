# Everything a fresh clone needs: `make run` starts the service, `make test` runs the tests.
# Both create .venv and install exactly the versions of requirements.lock (`make lock` refreshes
# it). With REDIS_URL / DATABASE_URL unset they start embedded Valkey and PostgreSQL servers and
# stop them on exit.

PYTHON ?= python3
# Every role, test and CLI process imports this project's modules: with PYTHONDONTWRITEBYTECODE set
# (some machines and images set it) none of them is ever cached, and each process compiles them all
# again (~0.9 s of CPU per server process, measured). Its .pyc files go to __pycache__ (ignored).
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The lock is universal (markers for other platforms and Python versions >= 3.11); the two local
# distributions are installed editable on top of it, without dependencies of their own.
LOCK_FLAGS := --universal --python-version 3.11 --no-emit-package scheduler-grpc \
	--no-emit-package scheduler-grpc-client --custom-compile-command "make lock"

.PHONY: run test lint docs docs-serve bench bench-detail chaos migrate lock lock-upgrade clean

# pip first (its locked version), then every locked package, then the two local distributions with
# --no-deps: nothing unlocked is installed, and `pip check` fails if the lock lacks a dependency
# (run `make lock` after changing pyproject.toml).
$(STAMP): pyproject.toml clients/python/pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$$(grep -m1 '^pip==' requirements.lock | cut -d' ' -f1)"
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e clients/python -e '.[embedded,dev,docs]'
	$(BIN)/python -m pip check
	@touch $(STAMP)

# Resolve requirements.in again into requirements.lock, keeping every pin that still fits;
# `make lock-upgrade` moves every package to its newest version allowed by pyproject.toml.
lock:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet "$$(grep -m1 '^uv==' requirements.lock | cut -d' ' -f1)"
	$(BIN)/uv pip compile --quiet $(LOCK_FLAGS) requirements.in -o requirements.lock

lock-upgrade:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet "$$(grep -m1 '^uv==' requirements.lock | cut -d' ' -f1)"
	$(BIN)/uv pip compile --quiet --upgrade $(LOCK_FLAGS) requirements.in -o requirements.lock

run: $(STAMP)
	$(BIN)/scheduler-grpc up

# The test files run on two processes (pytest-xdist; a file's tests stay together, sharing its
# module fixtures), each with embedded servers of its own. With REDIS_URL or REDIS_CLUSTER_URL set
# the tests share those servers and wipe them, so they run in one process (`PYTEST_WORKERS=0`).
PYTEST_WORKERS ?= $(if $(REDIS_URL)$(REDIS_CLUSTER_URL),0,2)

test: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy bench
	$(BIN)/mypy clients/python/scheduler_client --exclude 'scheduler_client/v1/'
	cd protos && npm install --no-audit --no-fund --silent && npx buf lint

# Every figure of issue 11 in one table, each with its ratio to a floor measured in the same run
# (bench/run.py; one embedded Valkey + PostgreSQL, or REDIS_URL / DATABASE_URL); JSON in .data/bench.json.
bench: $(STAMP)
	$(BIN)/python bench/run.py

# The older detailed benchmarks, one after another (each prints its own tables).
bench-detail: $(STAMP)
	$(BIN)/python bench/queue_bench.py
	$(BIN)/python bench/scheduling_bench.py
	$(BIN)/python bench/catchup_bench.py --jobs 200 --minutes 10
	$(BIN)/python bench/throughput_bench.py
	$(BIN)/python bench/api_load_bench.py

# The fault suite: every scenario against real processes and servers, one table at the end;
# exits non-zero on a duplicate, a lost slot, a stuck run, a stale-term write or a dead role.
chaos: $(STAMP)
	$(BIN)/python -m chaos

# The documentation site (mkdocs.yml, docs/), in strict mode: a broken link, a page missing from
# the nav or any other warning fails. The API, CLI, configuration and metrics references are
# generated from the code at build time (scripts/docs_gen.py). Output: site/ (git-ignored).
# NO_MKDOCS_2_WARNING: the theme's announcement of its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

migrate: $(STAMP)
	$(BIN)/scheduler-grpc migrate

clean:
	rm -rf $(VENV) site .data .mypy_cache .ruff_cache .pytest_cache .hypothesis
