# Quick start: `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FRAMEWORKS_STAMP := $(VENV)/.frameworks-installed

.PHONY: install chromium run test test-frameworks test-fast docs bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned: 2.13.0 resolves to the CPU build; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,docs,ray,chakra]"
	touch $(STAMP)

# The training frameworks whose own code runs on simulated ranks (simtrain torchtitan, simtrain megatron): optional
# extras, installed and tested by `make test-frameworks`.
$(FRAMEWORKS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[titan,megatron]"
	touch $(FRAMEWORKS_STAMP)

install: $(STAMP)

# tests/test_report_html.py renders the page `simtrain report --html` writes in headless Chromium: Debian's package,
# installed with apt-get where `chromium` is missing (CI runs as root). Without apt, or without root, the install is
# skipped with a note and those tests skip, saying why; `make install` never needs it.
chromium:
	@if ! command -v chromium >/dev/null; then \
		if command -v apt-get >/dev/null && apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then :; else \
			echo "no chromium (Debian's package, installed with apt-get as root): tests/test_report_html.py skips" \
				"its rendering checks"; fi; fi

run: install
	$(BIN)/simtrain run scenarios/quickstart.yaml

# Both cores (pytest-xdist), each test to the worker that is free; the tests sharing a module fixture (gloo process
# groups) on one worker, which builds it once (tests/conftest.py).
# The frameworks' tests (marker `frameworks`) run apart, in `make test-frameworks`, which .ci/run also calls: with
# them the suite would pass its 10 minutes on a 2-core machine.
TEST_WORKERS ?= auto
test: install chromium
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not frameworks"

test-frameworks: $(FRAMEWORKS_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m frameworks

# The suite without its slow tests, real gloo processes and the docs' pages (pytest markers, pyproject.toml).
test-fast: install chromium
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not gloo and not docs and not frameworks"

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/megatron_lm_table1.py

clean:
	rm -rf $(VENV) runs site
