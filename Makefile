# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
# The CPU build of torch is installed first, so no dependency pulls a multi-GB CUDA build.
PY    ?= python3
VENV  ?= .venv
TORCH ?= torch==2.13.0
ARGS  ?=

STAMP := $(VENV)/.swafactory-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q $(TORCH)
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

.PHONY: install run test matrix
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m swafactory $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n auto --dist loadgroup

matrix: $(STAMP)
	$(VENV)/bin/python tools/gen_support_matrix.py
