# modalmesh: `make run` starts the stack on local processes, `make test` runs the tests.
# Both set up a virtualenv first (idempotent). GPU hosts: make run TORCH=torch
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup run test test-floor protos clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 lies on this machine's disk; a plain `torch` would pull CUDA.
	$(PY) -m pip install -q "$(TORCH)"
	# Editable install; the gRPC stubs in modalmesh/v1/ are committed (`make protos` after editing proto/).
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/modalmesh up

test: setup
	PY=$(PY) scripts/test.sh

# The floor job: the lowest supported protobuf / grpcio / transformers in a second venv.
test-floor:
	scripts/test-floor.sh

# Regenerate the committed stubs with the one grpcio-tools they are pinned to (modalmesh/_protogen.py
# says why), in a throwaway venv: the project's own venv keeps its newer protobuf.
protos:
	rm -rf .venv-protogen
	$(PYTHON) -m venv .venv-protogen
	.venv-protogen/bin/python -m pip install -q "$$(sed -n 's/^GENERATOR = "\(.*\)".*/\1/p' modalmesh/_protogen.py)"
	.venv-protogen/bin/python modalmesh/_protogen.py
	rm -rf .venv-protogen

clean:
	rm -rf $(VENV) build *.egg-info
