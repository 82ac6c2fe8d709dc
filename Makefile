# kvquant: `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PY := .venv/bin/python
SCHEME ?= int4-g64
# test processes (pytest-xdist): one per core of the 2-core machine the README's times are from
WORKERS ?= 2

.PHONY: setup run quick test test-fast lint gpu-check docs

setup:
	./setup.sh

run: setup
	$(PY) experiments/run.py --scheme $(SCHEME)

quick: setup
	$(PY) experiments/run.py --scheme $(SCHEME) --quick

test: setup
	$(PY) -m pytest -q tests -n $(WORKERS)

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow" -n $(WORKERS)

lint: setup
	$(PY) -m ruff check kvquant kernels eval experiments benchmarks tests

gpu-check: setup
	bash benchmarks/gpu_check.sh

# docs/schemes.md from the code's own help (kvquant.scheme.scheme_help() and --list-schemes); tests/test_readme.py checks it
docs: setup
	$(PY) docs/generate.py
