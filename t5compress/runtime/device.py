"""Where the ONNX graphs run: `cpu`, `cuda` / `cuda:N` (ONNX Runtime's CUDA provider, GPU N) or `auto`.

`cuda` never falls back to the CPU in silence: ONNX Runtime itself does (a CUDA provider that cannot start leaves
a CPU session and a log line), so the session's providers are checked after it opens and a one-line ModelError
says which is missing: the CUDA provider (a CPU build of onnxruntime: `make gpu-env` puts onnxruntime-gpu in its
place, CUDA 13 and cuDNN 9 from its pip extras), or a GPU it can use (or the CUDA libraries). `auto` takes CUDA
when it starts, else the CPU, and logs which. Imports onnxruntime only (the runtime stays torch-free).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from t5compress.errors import ModelError

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "cuda:N", "auto")
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
GPU_EXTRA = "install the gpu extra: make gpu-env (onnxruntime-gpu in place of onnxruntime; CUDA 13, cuDNN 9)"
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A parsed --device: kind 'cpu', 'cuda' or 'auto', and the GPU index for cuda."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind


def parse_device(device: str) -> Device:
    """'cpu', 'cuda', 'cuda:N' or 'auto'; a one-line ModelError for anything else."""
    m = _DEVICE_RE.match(str(device).strip().lower())
    if not m or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ModelError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    return Device(m.group(1), int(m.group(2) or 0))


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def providers_for(device: str | Device) -> list[Any]:
    """The ONNX Runtime providers to open sessions with; `cuda` without a CUDA provider installed is a ModelError,
    `auto` without one is the CPU (logged)."""
    d = device if isinstance(device, Device) else parse_device(device)
    if d.kind == "cpu":
        return [CPU]
    if CUDA not in available_providers():
        if d.kind == "auto":  # open_on_device logs where the sessions run
            return [CPU]
        import onnxruntime as ort

        raise ModelError(f"--device {d.name}: onnxruntime {ort.__version__} here has no CUDA provider (a CPU build: "
                         f"{', '.join(available_providers())}); {_install_hint()}")
    _preload_cuda_libraries()
    # use_tf32 0: fp32 graphs compute in fp32, as PyTorch's matmuls do by default. ONNX Runtime's default (TF32 on
    # Ampere and later) made fp32 greedy disagree with PyTorch fp32 on 12% of a random flan-t5-small's tokens (H200).
    return [(CUDA, {"device_id": d.index, "use_tf32": 0}), CPU]


def _install_hint() -> str:
    """What to do without a CUDA provider; both ONNX Runtime builds installed is its own case (they share the
    `onnxruntime` module, so whichever was installed last answers)."""
    from importlib import metadata

    installed = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            installed.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    if len(installed) == 2:
        return (f"{' and '.join(installed)} are both installed and share one module: pip uninstall -y onnxruntime, "
                "then pip install --force-reinstall --no-deps onnxruntime-gpu (what `make gpu-env` does)")
    return GPU_EXTRA


def _preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN from the nvidia-* pip packages the gpu extra brings (ONNX Runtime >= 1.21 can; torch
    would do it on import, and the runtime imports no torch). Libraries on the system path work without it."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload()
    except Exception as e:  # a missing library shows as the provider failing to start, which check_session names
        log.info("onnxruntime.preload_dlls: %s", e)


def check_session(session, device: str | Device, path: Any = "") -> str:
    """The device `session` really runs on ('cuda:N' or 'cpu'); a ModelError when CUDA was asked for and ONNX
    Runtime fell back to the CPU (no GPU visible, or the CUDA 13 / cuDNN 9 libraries missing)."""
    d = device if isinstance(device, Device) else parse_device(device)
    on_cuda = CUDA in session.get_providers()
    if d.kind == "cuda" and not on_cuda:
        raise ModelError(f"--device {d.name}: ONNX Runtime's CUDA provider is installed but could not start for "
                         f"'{path}' ({gpu_visibility()}); nothing runs on the CPU unless --device auto or cpu")
    return d.name if on_cuda else "cpu"


def gpu_visibility() -> str:
    """Why CUDA may not start, in words: GPUs the NVIDIA driver lists here, or none."""
    import os
    from pathlib import Path

    gpus = sorted(Path("/proc/driver/nvidia/gpus").glob("*")) if Path("/proc/driver/nvidia/gpus").is_dir() else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not gpus:
        return "no NVIDIA GPU visible: no driver or device on this machine"
    hidden = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"{len(gpus)} GPU(s) listed by the driver{hidden}; check the GPU index and the CUDA 13 / cuDNN 9 libraries"


def describe(providers: Sequence[Any]) -> str:
    """'cuda:0' or 'cpu' for a providers list as `providers_for` builds it."""
    first = providers[0] if providers else CPU
    if isinstance(first, tuple) and first[0] == CUDA:
        return f"cuda:{first[1].get('device_id', 0)}"
    return "cuda:0" if first == CUDA else "cpu"
