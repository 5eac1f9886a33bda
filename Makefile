# `make test` and `make compare` set up .venv themselves (scripts/setup.sh) on first use.
PY := .venv/bin/python

.PHONY: setup test test-fast compare bench docs-figures clean

setup:
	@bash scripts/setup.sh

# The suite on up to 4 worker processes (pytest-xdist; each gets its share of the cores: tests/conftest.py):
# about twice as fast on 2 cores. `.venv/bin/python -m pytest -q` runs it in one process.
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses 4

test-fast: setup
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4

compare: setup
	.venv/bin/kvpolicy compare

bench: setup
	.venv/bin/kvpolicy bench

clean:
	rm -rf .venv .pytest_cache .hypothesis .benchmarks build *.egg-info
