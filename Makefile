# `make demo`: gateway on emulated workers.  `make test`: ruff, mypy, pytest.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint typecheck pytest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(RUN_STAMP)

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench,tokenizer,otel]'
	touch $(DEV_STAMP) $(RUN_STAMP)

demo: $(RUN_STAMP)
	$(BIN)/kvgate serve --demo

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# Two test processes: most tests wait on processes they start, so two use a 2-core machine
# better than one (README). `make test PYTEST_JOBS=0` runs them in one. A test file runs whole
# in one process, in order: its tests share module-scoped stacks of real processes.
PYTEST_JOBS ?= 2

pytest: $(DEV_STAMP)
	$(BIN)/pytest -q -n $(PYTEST_JOBS) --dist loadfile

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .import_linter_cache

# `make image`: the container image the Helm chart runs by default, kvgate:<pyproject version>.
IMAGE ?= kvgate
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
KVGATE_EXTRAS ?= tokenizer,otel,redis

.PHONY: image
image:
	docker build --build-arg KVGATE_EXTRAS=$(KVGATE_EXTRAS) -t $(IMAGE):$(IMAGE_TAG) .
