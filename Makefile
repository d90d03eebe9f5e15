# Two targets for a fresh machine: `make demo` (the main job) and `make test`.
# Both create or refresh .venv (Python 3.11) idempotently through scripts/install.sh.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MGRPO_CACHE ?= $(HOME)/.cache/megatron-grpo
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test install

install:
	@VENV=$(VENV) bash scripts/install.sh

demo: install
	@MGRPO_CACHE=$(MGRPO_CACHE) bash scripts/demo.sh $(DEMO_ARGS)

test: install
	@HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -ra --durations=15 \
		--timeout=1800 $(PYTEST_ARGS)
