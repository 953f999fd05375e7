#!/usr/bin/env bash
# GPU check for issue 18, in one call on a machine with one NVIDIA GPU (about 5-8 minutes with PyPI reachable):
#   benchmarks/gpu_check.sh [OUT_DIR] [-- gpu_check.py options, e.g. --shapes tiny --batches 1]
# With a GPU (nvidia-smi lists one): installs the gpu extra (`make gpu-env`: .venv-gpu with onnxruntime-gpu in place
# of onnxruntime; GPU_CHECK_PYTHON=/path/to/python skips that and uses an environment that has it), then runs
# benchmarks/gpu_check.py on cuda: random-weight t5-small and flan-t5-small shapes exported fp32 and fp16, fp16 parity
# and no NaN on CUDA, an fp16-overflow model, our runtime greedy and beam at b1/b8/b32 against PyTorch fp16 generate
# (and CTranslate2 if it imports) on the same GPU.
# Without a GPU (or with GPU_CHECK_DEVICE=cpu): one line saying none was found, then the same checks on the CPU with
# the project's .venv (the test suite runs this path with a tiny model: tests/test_gpu_check.py).
# Writes gpu_check.json and gpu_check.md (and a work/ folder) under OUT_DIR, default $OUT, else runs/gpu-check.
# Exit status: 0 all checks passed, 1 a parity / NaN check failed, 2 setup failed (install, no python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-runs/gpu-check}"
if [[ $# -gt 0 && "$1" != "--" ]]; then OUT_DIR="$1"; shift; fi
[[ "${1:-}" == "--" ]] && shift
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

if [[ "${GPU_CHECK_DEVICE:-auto}" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1 \
   && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  DEVICE=cuda
  GPU="$(nvidia-smi -L | head -1)"
  echo "gpu_check: $GPU; driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
  if [[ -z "${GPU_CHECK_PYTHON:-}" ]]; then
    echo "gpu_check: installing the gpu extra (make gpu-env -> .venv-gpu)"
    if ! make -C "$ROOT" gpu-env PY="${PY:-python3}" >"$OUT_DIR/install.log" 2>&1; then
      echo "gpu_check: installing the gpu extra failed (last lines of $OUT_DIR/install.log):"; tail -5 "$OUT_DIR/install.log"
      exit 2
    fi
    GPU_CHECK_PYTHON="$ROOT/.venv-gpu/bin/python"
  fi
  NOTE="$GPU"
else
  DEVICE=cpu
  NOTE="no NVIDIA GPU found (nvidia-smi missing or lists none): the same checks on the CPU"
  [[ "${GPU_CHECK_DEVICE:-auto}" == cpu ]] && NOTE="GPU_CHECK_DEVICE=cpu: the same checks on the CPU"
  echo "gpu_check: $NOTE"
  if [[ -z "${GPU_CHECK_PYTHON:-}" ]]; then
    for candidate in "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
      if [[ -x "$candidate" ]]; then GPU_CHECK_PYTHON="$candidate"; break; fi
    done
  fi
fi
[[ -x "${GPU_CHECK_PYTHON:-}" ]] || { echo "gpu_check: no python found (set GPU_CHECK_PYTHON)"; exit 2; }
"$GPU_CHECK_PYTHON" -c "import onnxruntime as o; print('gpu_check: onnxruntime', o.__version__, o.get_available_providers())" \
  || { echo "gpu_check: $GPU_CHECK_PYTHON cannot import onnxruntime (set GPU_CHECK_PYTHON to the project's venv)"; exit 2; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$GPU_CHECK_PYTHON" "$ROOT/benchmarks/gpu_check.py" --out "$OUT_DIR" --device "$DEVICE" --note "$NOTE" "$@"
