# One-command entry points for a fresh clone. Every target builds the virtual environment first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[peers,dev]'
	touch $(STAMP)

demo: $(STAMP)  ## build, fine-tune, evaluate and export a small T5 on generated data
	$(BIN)/t5compress demo --out runs/demo --force

test: $(STAMP)  ## the whole suite, slow tests included (what CI runs)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check t5compress tests benchmarks

clean:
	rm -rf $(VENV) runs
