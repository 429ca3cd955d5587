# make run: serve keel (embedded Valkey, demo agent) on 127.0.0.1:8000.  make test: the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install dev run worker test lint typecheck bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/python -m app

worker: install
	$(BIN)/python -m app.worker

lint: install
	$(BIN)/ruff check
	$(BIN)/ruff format --check

typecheck: install
	$(BIN)/mypy
	$(BIN)/mypy --strict deploy/bench/*.py

test: install lint typecheck
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python deploy/bench/bench_http.py

clean:
	rm -rf $(VENV) .keel .pytest_cache .mypy_cache .ruff_cache
