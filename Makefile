# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install install-compiled demo test test-compose bench clean

$(STAMP): pyproject.toml codecs/sglang-zstd/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' -e ./codecs/sglang-zstd
	touch $(STAMP)

install: $(STAMP)

# Optional: the per-message modules compiled with mypyc (14-26% less CPU per chunk in durable mode
# and passthrough, docs/benchmarks.md). Needs a C compiler and Python.h; `scripts/build-compiled
# clean` (or `make clean`) goes back to pure Python. Rebuild after editing a compiled module:
# `import streamproc` refuses a compiled module whose source changed (streamproc/compiled.py).
install-compiled: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[compiled]'
	$(BIN)/python scripts/build-compiled

demo: $(STAMP)
	$(BIN)/streamproc demo

test: $(STAMP)
	scripts/install-system-deps
	$(BIN)/python -m pytest

# `docker compose up --build` for real (tests/test_compose_real.py): starts dockerd if none runs,
# builds offline stand-in base images if the official ones cannot be pulled. Needs root and
# Debian's docker.io and debootstrap (.ci/run installs them); see docs/compose.md.
$(VENV)/.compose: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[compose]'
	touch $@

test-compose: $(STAMP) $(VENV)/.compose
	$(BIN)/python -m pytest -m docker tests/test_compose_real.py

# Every benchmark, one summary table against issue 14's targets, plots into docs/img/ (~8 min;
# BENCH_QUICK=1 for a few minutes, BENCH_ONLY=join,latency for a subset). See docs/benchmarks.md.
$(VENV)/.bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $@

bench: $(STAMP) $(VENV)/.bench
	$(BIN)/python benchmarks/run.py

clean:
	[ ! -x $(BIN)/python ] || $(BIN)/python scripts/build-compiled clean
	rm -rf $(VENV) .pytest_cache .hypothesis artifacts
