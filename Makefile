# `make train` and `make test` do the whole set-up on a fresh machine (CPU torch by default).
# On GPU/NPU clusters bring your own torch: `make test TORCH_SPEC=torch` or see README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/internlm2_tiny.py
# `--durations=25` prints the slowest tests at the end of every run (CI time is watched).
PYTEST_ARGS ?= --durations=25
# Test processes (pytest-xdist); a file's tests stay in one process (module fixtures are built once).
# Most tests run train.py in subprocesses with one thread each, so one worker per core keeps them busy.
PYTEST_WORKERS ?= 2

.PHONY: setup train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,hf]"
	touch $@

train: setup
	$(PY) train.py --config $(CONFIG)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) work_dirs .pytest_cache
