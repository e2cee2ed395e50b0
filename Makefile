# The two commands of the README: `make train` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: train test lint typecheck unit install

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: here this takes the CPU build; an unpinned torch pulls CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,plot,tensorboard]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) examples/dlrm/train.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck unit
