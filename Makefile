# One-command entry points for a fresh clone. Every target builds the virtual environment first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean bench bench-env

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

# The speed benchmark's peers (CTranslate2, OpenVINO via optimum-intel) live in their own venv: optimum-intel pulls a
# torchvision built for another torch and needs huggingface-hub<1 / datasets<4.4, which must not reach .venv.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q -e '.[peers,bench]'
	$(BENCH_VENV)/bin/pip uninstall -q -y torchvision 2>/dev/null || true  # built for another torch: breaks imports
	$(BENCH_VENV)/bin/python -c "import torch, transformers, optimum.onnxruntime, optimum.intel, ctranslate2, t5compress"
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)  ## the benchmark venv with every peer engine installed

bench: $(BENCH_STAMP)  ## every engine side by side (minutes); ARGS='--quick' for a short run
	$(BENCH_VENV)/bin/python benchmarks/generate_speed.py $(ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs
