# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test laws bench clean

$(STAMP): pyproject.toml codecs/sglang-zstd/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' -e ./codecs/sglang-zstd
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/streamproc demo

test: $(STAMP)
	scripts/install-system-deps
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis artifacts
