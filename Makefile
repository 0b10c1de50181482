# Every target sets itself up: a virtual environment in .venv with torch==2.13.0 pinned first
# (the CPU wheel; an unpinned torch would pull a multi-GB CUDA build), then the package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | $(PY) -c "import sys,hashlib;print(hashlib.sha1(sys.stdin.buffer.read()).hexdigest()[:12])")

.PHONY: setup quickstart test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[all,dev]"
	touch $@

## The main job on an embedded default corpus (the Python standard library's docstrings).
quickstart: setup
	$(BIN)/encoderkit quickstart --out runs/quickstart --overwrite

## Lint (E501, imports at the top: pyproject's ruff settings), then the whole test suite (slow tests on real data
## included; they skip without ../shared/data).
test: setup
	$(BIN)/ruff check encoderkit tests bench
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: setup
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

lint: setup
	$(BIN)/ruff check encoderkit tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
