# Two commands matter: `make demo` (see it work) and `make test` (see it pass).
# Both bootstrap what they need: a .venv, and on Debian as root the system packages
# the tests use (redis-server, prometheus; the Pub/Sub emulator is found via dpkg).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 4

.PHONY: all venv constraints image-lock image image-test chart sysdeps demo test test-fast lint typecheck bench \
	bench-harvest clean

all: test

EXTRAS := dev,otel,demo

# Versions come from constraints.txt (also used by the Dockerfile), so CI and a fresh clone
# install what was tested.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

venv: $(STAMP)

# Re-pin constraints.txt to the newest versions pyproject.toml allows: resolve in a
# throwaway venv without constraints, keep the header, freeze.
constraints:
	rm -rf .venv-constraints
	$(PY) -m venv .venv-constraints
	.venv-constraints/bin/pip install -q -e '.[$(EXTRAS),bench]'  # bench: pinned, not in venv
	{ grep '^#' constraints.txt; .venv-constraints/bin/pip freeze --exclude-editable; } \
		> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-constraints

# The image's runtime dependencies with hashes (requirements-image.txt), after `make
# constraints` or a change to pyproject.toml's dependencies.
image-lock: venv
	$(BIN)/python scripts/lock_image.py

# The container image, built with podman from a local Debian base and a host-built
# wheelhouse (scripts/image.sh); prints its size and layer count. IMAGE= names it.
image: venv
	@PYTHON=$(BIN)/python bash scripts/image.sh

# The image run as the chart runs it (read-only, UID 10001, no capabilities) against a
# redis-server and the simulator on the host (tests/deploy/test_image.py).
image-test: venv sysdeps image
	$(BIN)/pytest -p no:cacheprovider tests/deploy/test_image.py

# The chart as a .tgz under dist/ (with values.schema.json) for `helm push ... oci://...`
# (docs/operations.md, "Publish the chart").
chart: venv
	$(BIN)/python -c 'import helm_python as h; print(h.package("charts/async-processor", destination="dist"))'

# System services the integration tests start on free ports (never the shared 6379).
sysdeps:
	@bash scripts/sysdeps.sh

demo: venv sysdeps
	$(BIN)/async-processor demo

test: venv sysdeps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup tests

# Without the image build and run (make image-test).
test-fast: venv
	$(BIN)/pytest tests/unit tests/deploy --ignore=tests/deploy/test_image.py

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Every benchmark, one after the other (about 5 min); the run's tables replace the section
# between the bench markers at the end of docs/performance.md (bench/docs.py).
bench: venv sysdeps
	$(BIN)/python -m bench --docs docs/performance.md

# Harvest of idle pool capacity vs interactive impact, per gate strategy (about 15 min;
# HARVEST_ARGS=--quick for about 3). Tables, JSON and PNGs under /tmp/async-processor-bench.
bench-harvest: venv sysdeps
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python -m bench.harvest $(HARVEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
