# One-command entry points for a fresh clone. Every target builds the virtual environment first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

# onnx-neural-compressor 1.0 (quantize --tolerance) declares numpy<2, but the path we use (StaticQuantConfig,
# its calibration and quantizer, tuning.autotune) runs under numpy 2: tests/test_tune.py runs exactly that path.
# Installed with its dependencies it would downgrade numpy, so it goes in --no-deps, its dependencies come from
# the `inc` extra, and `pip check` reports that one pin and nothing else (tests/test_tune.py checks it).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[peers,dev,inc]'
	$(BIN)/pip install -q --no-deps 'onnx-neural-compressor==1.0'
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
