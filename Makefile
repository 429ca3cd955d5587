# make run: serve keel (embedded Valkey, demo agent) on 127.0.0.1:8000.  make test: the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install dev run worker test test-cluster lint typecheck bench loadtest smoke slack-demo browser js clean

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
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy
	$(BIN)/mypy --strict deploy/bench/*.py
	cd deploy && MYPYPATH=bench:.. ../$(BIN)/mypy --strict smoke.py
	cd deploy && MYPYPATH=bench:.. ../$(BIN)/mypy --strict ws_load.py
	cd deploy && MYPYPATH=.. ../$(BIN)/mypy --strict slack_demo.py
	cd deploy && MYPYPATH=.. ../$(BIN)/mypy --strict rolling_restart.py
	$(BIN)/mypy --strict --explicit-package-bases --follow-imports=silent deploy/loadtest/*.py

# Debian's chromium for tests/browser: installed when missing and this is root with apt;
# otherwise those tests are skipped, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	      echo "could not install chromium: the browser tests will be skipped"; \
	  else echo "no chromium, and no root apt-get to install it: the browser tests will be skipped"; fi; }

# The pinned Node toolchain in tests/js (ai, @ai-sdk/react, @ag-ui/client, react, esbuild) for the
# tests that drive keel with the real JavaScript clients: `npm ci` from its package-lock.json when
# the lock is newer than the stamp; without node/npm, says so (those tests are then skipped).
JS := tests/js
JS_STAMP := $(JS)/node_modules/.keel-installed

js:
	@if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then \
	  echo "no node/npm on PATH: tests/js not installed, the JavaScript client tests will be skipped"; \
	elif [ ! -f $(JS_STAMP) ] || [ $(JS)/package-lock.json -nt $(JS_STAMP) ] || [ $(JS)/package.json -nt $(JS_STAMP) ]; then \
	  echo "installing tests/js with npm ci (node $$(node --version))"; \
	  cd $(JS) && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.keel-installed; \
	fi

# The suites that run a second time on a real Valkey Cluster (3 primaries, 3 replicas): the
# crash suites, the core routes, the conversations (list, fork, policies, the owners' lists),
# and the event hub's notices and live deltas.
CLUSTER_SUITES := tests/channels/test_http.py tests/harness/test_approvals.py tests/channels/test_websocket.py tests/crash \
  tests/channels/test_conversations.py tests/channels/test_fork.py tests/channels/test_policies.py tests/harness/test_catalog.py \
  tests/harness/test_hub.py tests/channels/test_deltas.py

test: install lint typecheck browser js
	$(BIN)/python -m pytest -q
	KEEL_TEST_REDIS=cluster $(BIN)/python -m pytest -q $(CLUSTER_SUITES)

test-cluster: install
	KEEL_TEST_REDIS=cluster $(BIN)/python -m pytest -q $(CLUSTER_SUITES)

slack-demo: install
	$(BIN)/python deploy/slack_demo.py

# Every ratio keel is held to (in-process, HTTP, cluster, memory), medians of 3 runs: prints the
# table and writes deploy/bench/results.json (a few minutes). BENCH_ARGS=--readme also makes
# README.md's table again from it.
bench: install
	$(BIN)/python deploy/bench/suite.py $(BENCH_ARGS)

# 1 vs 2 keel processes on one Valkey and on a cluster, 3 rounds, and the projection (about 11 min).
loadtest: install
	$(BIN)/python deploy/loadtest/scaling.py

# One real turn per provider whose key is set (ANTHROPIC_API_KEY, OPENAI_API_KEY); skips the others.
smoke: install
	$(BIN)/python deploy/smoke.py

clean:
	rm -rf $(VENV) .keel .pytest_cache .mypy_cache .ruff_cache
