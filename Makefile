# Two commands matter: `make demo` (see it work) and `make test` (see it pass).
# Both bootstrap what they need: a .venv, and on Debian as root the system packages
# the tests use (redis-server, prometheus; the Pub/Sub emulator is found via dpkg).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 4

.PHONY: all venv sysdeps demo test test-fast lint typecheck bench clean

all: test

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,otel]'
	touch $(STAMP)

venv: $(STAMP)

# System services the integration tests start on free ports (never the shared 6379).
sysdeps:
	@bash scripts/sysdeps.sh

demo: venv sysdeps
	$(BIN)/async-processor demo

test: venv sysdeps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup tests

test-fast: venv
	$(BIN)/pytest tests/unit

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: venv sysdeps
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
