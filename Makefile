# modalmesh: `make run` starts the stack on local processes, `make test` runs the tests.
# Both set up a virtualenv first (idempotent). GPU hosts: make run TORCH=torch
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup run test protos clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard proto/modalmesh/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 lies on this machine's disk; a plain `torch` would pull CUDA.
	$(PY) -m pip install -q "$(TORCH)"
	# Editable install: setup.py generates the gRPC stubs from proto/ into modalmesh/v1/.
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/modalmesh up

test: setup
	PY=$(PY) scripts/test.sh

protos: setup
	$(PY) modalmesh/_protogen.py

clean:
	rm -rf $(VENV) modalmesh/v1 build *.egg-info
