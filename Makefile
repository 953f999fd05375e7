# One-command entry points for a fresh clone. Every target builds the virtual environment first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Triton server's own environment: nvidia-pytriton (tritonserver + python backend) pins numpy<2, and its python
# backend stub answers with empty tensors under numpy 2, so it cannot share the project's venv (numpy 2).
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
TRITON_REQS := triton_models/requirements.txt

.PHONY: demo test test-fast lint docs clean triton-env bench bench-env gpu-env gpu-check

# onnx-neural-compressor 1.0 (quantize --tolerance) declares numpy<2, but the path we use (StaticQuantConfig,
# its calibration and quantizer, tuning.autotune) runs under numpy 2: tests/quantize/test_tune.py runs exactly that path.
# Installed with its dependencies it would downgrade numpy, so it goes in --no-deps, its dependencies come from
# the `inc` extra, and `pip check` reports that one pin and nothing else (tests/quantize/test_tune.py checks it).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[peers,dev,triton,inc]'
	$(BIN)/pip install -q --no-deps 'onnx-neural-compressor==1.0'
	touch $(STAMP)

$(TRITON_STAMP): $(TRITON_REQS)
	test -x $(TRITON_VENV)/bin/python || $(PY) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install -q --upgrade pip
	$(TRITON_VENV)/bin/pip install -q -r $(TRITON_REQS) "nvidia-pytriton==0.7.0"
	touch $(TRITON_STAMP)

triton-env: $(TRITON_STAMP)  ## Triton server environment (~25 s, ~0.5 GB): what `t5compress serve` runs

# The quickstart recipe (recipes/quickstart.yaml, embedded in the package): generated data, a tiny T5 fine-tuned on it,
# ONNX, int8 and pruned + int8 variants, ending in the bench report (runs/quickstart/bench/report.md and plots).
# A second `make demo` skips every stage that is done and unchanged; `make demo ARGS=--force` redoes them all.
demo: $(STAMP)  ## the quickstart recipe: train, export, int8, prune a small T5 on generated data, then benchmark
	$(BIN)/t5compress demo $(ARGS)

test: $(STAMP) $(TRITON_STAMP)  ## the whole suite, slow and server tests included (what CI runs)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check t5compress triton_models tests benchmarks

docs: $(STAMP)  ## rewrite the generated option tables in docs/*.md from the CLI (tests/cli/test_docs.py checks them)
	$(BIN)/python -m t5compress.cli.docgen

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

bench: $(BENCH_STAMP)  ## the goals benchmark: t5compress bench on the t5-small, el2 and flan-t5-small shapes, every peer (tens of minutes); ARGS='--quick' for a short run
	$(BENCH_VENV)/bin/python benchmarks/generate_speed.py $(ARGS)

# GPU: the `gpu` extra's onnxruntime-gpu (CUDA 13, cuDNN 9 from its own pip extras; needs an NVIDIA driver for CUDA
# 13) in its own venv. onnxruntime (CPU, a main dependency) and onnxruntime-gpu install the same `onnxruntime` module,
# so the CPU one is uninstalled and onnxruntime-gpu reinstalled over the files that removed (the known recipe); `pip
# check` then reports t5compress's onnxruntime requirement as missing, and nothing else. ORT_GPU is the extra's range
# (tests/runtime/test_runtime_device.py checks they agree). torch from PyPI on Linux is its CUDA build here (for the PyTorch
# fp16 rows of benchmarks/gpu_check.sh).
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
ORT_GPU := onnxruntime-gpu[cuda,cudnn]>=1.31,<1.33

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q -e '.[gpu,dev]'
	$(GPU_VENV)/bin/pip uninstall -q -y onnxruntime
	$(GPU_VENV)/bin/pip install -q --force-reinstall --no-deps '$(ORT_GPU)'
	$(GPU_VENV)/bin/python -c "import onnxruntime as o; p = o.get_available_providers(); assert 'CUDAExecutionProvider' in p, p"
	touch $(GPU_STAMP)

gpu-env: $(GPU_STAMP)  ## .venv-gpu: t5compress with onnxruntime-gpu in place of onnxruntime (CUDA 13 + cuDNN 9 wheels)

gpu-check:  ## benchmarks/gpu_check.sh: fp16 parity, no NaN and speed on the GPU (CPU fallback without one); results in runs/gpu-check
	benchmarks/gpu_check.sh runs/gpu-check

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(BENCH_VENV) $(GPU_VENV) runs
