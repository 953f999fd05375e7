"""The CPU features that decide int8 speed, read from /proc/cpuinfo, and the int8 preset to use on arm64.

x86-64: AVX2 (int8 through VPMADDUBSW), AVX-512F, AVX-512 VNNI / AVX-VNNI (int8 dot products in one instruction),
AMX (tile int8 matrix multiply). arm64: ASIMD (NEON), ASIMDDP (the int8 dot-product instructions SDOT/UDOT) and
I8MM (int8 matrix multiply SMMLA/UMMLA).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

X86_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni",
             "amx": "amx_int8"}
ARM_FLAGS = {"neon": "asimd", "dotprod": "asimddp", "i8mm": "i8mm"}

# ONNX Runtime's quantization guide ("Data type selection"): its CPU kernels take uint8 activations; on arm64, U8S8
# (uint8 activations, int8 weights) "can be faster than U8U8 for low end ARM64 and no difference on accuracy", with
# no difference on high-end cores; its FAQ adds that ARM cores with the dot-product instructions get better int8
# performance in general. t5compress quantize writes U8S8 (QUInt8 activations, QInt8 per-channel weights) in both
# modes, which is that preset, and optimum's `AutoQuantizationConfig.arm64` is the same choice.
ARM64_PRESET = (
    "arm64: int8 as U8S8 (uint8 activations, int8 weights, per channel) -- what `t5compress quantize` writes in "
    "both modes and optimum's AutoQuantizationConfig.arm64 picks. ONNX Runtime's quantization guide: U8S8 can be "
    "faster than U8U8 on low-end arm64 with no accuracy difference (no difference on high-end cores); cores with "
    "the dot-product instructions (asimddp) get the int8 speed-up, cores without them may not. Prefer static int8 "
    "(no per-call range computation) when calibration texts exist, else dynamic; 1-2 threads.")


def _flags(text: str) -> set[str]:
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags |= set(value.split())
    return flags


def _model_name(text: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name", "cpu model", "hardware"):
            return value.strip()
    return None


def cpu_features(cpuinfo: str | None = None, machine: str | None = None) -> dict:
    """{'arch', 'model', 'cpus', and one bool per feature of that architecture} (both arches' names when unknown)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    machine = (machine or platform.machine()).lower()
    arch = "arm64" if machine in ("aarch64", "arm64") else ("x86_64" if machine in ("x86_64", "amd64") else machine)
    flags = _flags(cpuinfo)
    table = ARM_FLAGS if arch == "arm64" else X86_FLAGS
    out = {"arch": arch, "model": _model_name(cpuinfo), "cpus": os.cpu_count()}
    out.update({name: flag in flags for name, flag in table.items()})
    return out


def int8_note(features: dict) -> str:
    """One line on what this CPU offers int8 kernels."""
    if features["arch"] == "arm64":
        if features.get("i8mm"):
            return "int8 matrix multiply (i8mm) and dot product: the fastest arm64 int8 kernels"
        if features.get("dotprod"):
            return "int8 dot product (asimddp): int8 pays off"
        return "NEON without dot product: int8 may not be faster than fp32"
    if features.get("amx"):
        return "AMX int8 tiles and VNNI: the fastest x86 int8 kernels"
    if features.get("avx512_vnni") or features.get("avx_vnni"):
        return "VNNI int8 dot product: int8 pays off"
    if features.get("avx2"):
        return "AVX2 without VNNI: int8 helps less; U8S8 may saturate (reduce_range)"
    return "no AVX2: int8 may be slower than fp32"


# ONNX Runtime's x86 int8 kernels without VNNI multiply uint8 activations by int8 weights with VPMADDUBSW, which adds
# two products into int16 and saturates: 2 x 255 x 127 overflows it, 2 x 255 x 63 does not. Its quantization guide's
# answer is reduce_range (7-bit weights) on such CPUs; measured here (AVX2, no VNNI), a QAT export with +-127 weights
# differed from its fake-quantized model by 0.23 of the logits' scale, and by less than 0.1 with +-63.
WEIGHT_RANGES = ("auto", "full", "reduced")
FULL_WEIGHT_MAX, REDUCED_WEIGHT_MAX = 127, 63


def saturates_int8(features: dict | None = None) -> bool:
    """Whether this CPU's u8 x s8 int8 kernels saturate full-range int8 weights: x86 without VNNI or AMX."""
    f = features or cpu_features()
    return f["arch"] == "x86_64" and not (f.get("avx512_vnni") or f.get("avx_vnni") or f.get("amx"))


def weight_max(weight_range: str) -> int:
    """The largest int8 weight magnitude for `weight_range` (auto: reduced where the kernels saturate)."""
    if weight_range == "auto":
        return REDUCED_WEIGHT_MAX if saturates_int8() else FULL_WEIGHT_MAX
    return REDUCED_WEIGHT_MAX if weight_range == "reduced" else FULL_WEIGHT_MAX


def memory_read_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in GB/s: the best of `repeats` numpy sums over a `megabytes` array (far
    larger than any cache), the figure that bounds a decoder step whose weights are read once each."""
    import time

    import numpy as np

    a = np.ones(megabytes * 2**20 // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return round(a.nbytes / best / 1e9, 1)
