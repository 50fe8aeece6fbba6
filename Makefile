# Quick start: `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast docs bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned: 2.13.0 resolves to the CPU build; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,docs,ray,chakra]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/simtrain run scenarios/quickstart.yaml

# Both cores (pytest-xdist), each test to the worker that is free; the tests sharing a module fixture (gloo process
# groups) on one worker, which builds it once (tests/conftest.py).
TEST_WORKERS ?= auto
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The suite without its slow tests, real gloo processes and the docs' pages (pytest markers, pyproject.toml).
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not gloo and not docs"

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/megatron.py

clean:
	rm -rf $(VENV) runs site
