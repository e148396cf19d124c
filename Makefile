# The front door. `make help` lists the targets; README.md explains them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
REQS   := requirements-airflow.txt requirements.txt requirements-dev.txt

export PYTHONPATH := $(CURDIR)

.PHONY: help venv test lint fix demo up down bench bench-smoke clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): $(REQS)
	@test -n "$(PYTHON)" || { echo "Python 3.11 is required (python3.11 or python3 on PATH)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(addprefix -r ,$(REQS))
	@touch $@

venv: $(STAMP) ## create .venv from the pinned requirements (done by every target on first use)

test: $(STAMP) ## run the whole test suite (unit, integration on real Postgres, DAG runs)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP) ## ruff check + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fix: $(STAMP) ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: $(STAMP) ## embedded Postgres + demo data + selections service, run every DAG, print a report
	$(BIN)/python -m devtools.demo

up: $(STAMP) ## local Airflow with its UI on the embedded Postgres (Ctrl-C or `make down` stops it)
	$(BIN)/python -m devtools.local_airflow up

down: $(STAMP) ## stop everything `make up` started
	$(BIN)/python -m devtools.local_airflow down

bench: $(STAMP) ## benchmarks against the physical limit; writes docs/benchmarks.md
	$(BIN)/python -m devtools.bench

bench-smoke: $(STAMP) ## the benchmark at tiny sizes (also part of make test)
	$(BIN)/python -m devtools.bench --smoke

clean: ## stop the embedded Postgres, remove .local/ and caches (keeps .venv)
	-@test -x $(BIN)/python && $(BIN)/python -m devtools.pg stop
	rm -rf .local .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +
