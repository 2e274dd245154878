VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench setup clean

$(VENV)/.bootstrapped: pyproject.toml scripts/bootstrap.sh proto/build.py $(wildcard proto/pdserve/v1/*.proto)
	bash scripts/bootstrap.sh $(VENV)

setup: $(VENV)/.bootstrapped

demo: $(VENV)/.bootstrapped
	$(VENV)/bin/pdserve demo

# Lint and format checks first (seconds), so a badly formatted tree fails before the suite runs.
test: $(VENV)/.bootstrapped
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q tests

bench: $(VENV)/.bootstrapped
	$(PY) -m benchmarks.engine_bench

clean:
	rm -rf $(VENV)
