# `make test` and `make compare` set up .venv themselves (scripts/setup.sh) on first use.
PY := .venv/bin/python

.PHONY: setup test test-fast compare bench docs-figures clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

compare: setup
	.venv/bin/kvpolicy compare

bench: setup
	.venv/bin/kvpolicy bench

clean:
	rm -rf .venv .pytest_cache .hypothesis .benchmarks build *.egg-info
