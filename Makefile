# The front door. `make help` lists the targets; README.md explains them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
REQS   := requirements-airflow.txt requirements.txt requirements-dev.txt
# the scheduler-side distribution (scheduler_plugin/), installed like the Dockerfile installs it
PLUGIN_STAMP := $(VENV)/.plugin-stamp
PLUGIN_SRC   := scheduler_plugin/pyproject.toml $(wildcard scheduler_plugin/src/pin_maintenance_plugin/*.py)

export PYTHONPATH := $(CURDIR)
# make test: four pytest-xdist workers; the tiers that start Airflow stacks share one (one
# stack at a time), the others take the rest (tests/conftest.py). More workers than cores:
# much of the suite waits on Airflow, services and sockets (measured in docs/testing.md, "How
# long it takes"). PYTEST_WORKERS=0: no xdist.
PYTEST_WORKERS ?= 4
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: help venv test lint fix demo up down screenshots bench bench-smoke clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): $(REQS)
	@test -n "$(PYTHON)" || { echo "Python 3.11 is required (python3.11 or python3 on PATH)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(addprefix -r ,$(REQS))
	@touch $@

$(PLUGIN_STAMP): $(STAMP) $(PLUGIN_SRC)
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall ./scheduler_plugin
	@rm -rf scheduler_plugin/build scheduler_plugin/src/*.egg-info
	@touch $@

venv: $(PLUGIN_STAMP) ## create .venv from the pinned requirements (done by every target on first use)

test: $(PLUGIN_STAMP) ## run the whole test suite (unit, integration on real Postgres, DAG runs)
	$(BIN)/python -m pytest $(PYTEST_XDIST) --durations=30 $(PYTEST_ARGS)

lint: $(PLUGIN_STAMP) ## ruff check + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fix: $(PLUGIN_STAMP) ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: $(PLUGIN_STAMP) ## embedded Postgres + demo data + selections service, run every DAG, print a report
	$(BIN)/python -m devtools.demo

up: $(PLUGIN_STAMP) ## local Airflow with its UI on the embedded Postgres (Ctrl-C or `make down` stops it)
	$(BIN)/python -m devtools.local_airflow up

down: $(PLUGIN_STAMP) ## stop everything `make up` started
	$(BIN)/python -m devtools.local_airflow down

screenshots: $(PLUGIN_STAMP) ## the make-up UI in headless Chromium: docs/screenshots/*.png
	$(BIN)/python -m devtools.screenshots

bench: $(PLUGIN_STAMP) ## benchmarks against the physical limit; writes docs/benchmarks.md
	$(BIN)/python -m devtools.bench

bench-smoke: $(PLUGIN_STAMP) ## the benchmark at tiny sizes (the Airflow-heavy sections too; the rest is part of make test)
	$(BIN)/python -m devtools.bench --smoke
	$(BIN)/python -m devtools.bench --smoke --only detach_capacity airflow neighbours --out .local/bench/airflow-smoke.md

clean: ## stop the embedded Postgres, remove .local/ and caches (keeps .venv)
	-@test -x $(BIN)/python && $(BIN)/python -m devtools.pg stop
	rm -rf .local .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +
