PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the pinned dependencies change.
STAMP := $(VENV)/.installed

.PHONY: venv test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/scheduler_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
