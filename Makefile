PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the pinned dependencies change.
STAMP := $(VENV)/.installed

SIZE ?= tiny
MODEL_DIR := models/flagstop-$(SIZE)
# Nothing is ever fetched from a model hub.
export HF_HUB_OFFLINE := 1

.PHONY: venv test lint bench model clean

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

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: $(STAMP) executor/make_model.py
	$(PY) -m executor.make_model --size $(SIZE) --out $(MODEL_DIR)

bench: $(STAMP)
	$(PY) bench/scheduler_bench.py
	$(PY) bench/executor_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
