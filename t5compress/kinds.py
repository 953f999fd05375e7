"""What a directory is, decided in one place from the files it holds: a registry of directory kinds.

    kind_of("runs/qat")         # -> DirKind(name="qat-model", ...)
    export_hook("runs/qat")     # -> the function that prepares a QAT model and its exporter

Every kind names the files that make it, what reads it, and (for sources of `export`) where the code that exports
it lives, as a "module:function" reference loaded when needed: `export` knows that a QAT dir is exported by the QAT
package without importing it, so no lower part of the house imports a higher one. The kinds are tried in order,
the most specific first (a QAT dir is also a model dir).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from t5compress.errors import ModelError
from t5compress.names import GRAPHS, LAYOUT_KEY, ONNX_SUFFIX, TORCHSCRIPT_SUFFIX

SCALES_JSON = "quantization.json"  # learned int8 scales beside a QAT model's weights
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class DirKind:
    name: str
    label: str  # what `info` calls it
    holds: Callable[[Path], bool]  # whether a directory is of this kind
    exporter: str | None = None  # "module:function" preparing (model, exporter) for `export`, if not the default


def _has_any(p: Path, names) -> bool:
    return any((p / n).is_file() for n in names)


def is_model_dir(p: Path) -> bool:
    return _has_any(p, WEIGHTS)


def is_qat_dir(p: Path) -> bool:
    """Learned int8 scales beside the weights (written by `t5compress qat`)."""
    return is_model_dir(p) and (p / SCALES_JSON).is_file()


def has_layout(p: Path) -> bool:
    """A config.json recording per-layer sizes (a non-uniformly pruned model)."""
    try:
        return LAYOUT_KEY in json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False


def is_onnx_export(p: Path) -> bool:
    return _has_any(p, [f"{g}{ONNX_SUFFIX}" for g in GRAPHS])


def is_torchscript_export(p: Path) -> bool:
    return _has_any(p, [f"{g}{TORCHSCRIPT_SUFFIX}" for g in GRAPHS])


def is_triton_repository(p: Path) -> bool:
    return any(c.is_dir() and (c / "config.pbtxt").is_file() for c in p.iterdir())


KINDS: list[DirKind] = [
    DirKind("qat-model", "model (QAT int8 scales)", is_qat_dir, exporter="t5compress.qat.qdq:prepare_export"),
    DirKind("pruned-model", "model (pruned, per-layer sizes)", lambda p: is_model_dir(p) and has_layout(p)),
    DirKind("model", "model", is_model_dir),
    DirKind("onnx-export", "onnx export", is_onnx_export),
    DirKind("torchscript-export", "torchscript export", is_torchscript_export),
    DirKind("triton-repository", "Triton model repository", is_triton_repository),
    DirKind("bench", "bench report", lambda p: (p / "bench.json").is_file()),
]


def register(kind: DirKind, before: str | None = None) -> None:
    """Add a kind (before the kind named `before`, so that it is tried first)."""
    at = next((i for i, k in enumerate(KINDS) if k.name == before), len(KINDS))
    KINDS.insert(at, kind)


def kind_of(path: str | Path) -> DirKind | None:
    """The first kind `path` holds, or None (a hub id, a missing path, a file, an unknown directory)."""
    p = Path(path)
    if not p.is_dir():
        return None
    return next((k for k in KINDS if k.holds(p)), None)


def require_kind(path: str | Path, *names: str) -> DirKind:
    """The kind of `path`, which must be one of `names`; else one line saying what it is and what was wanted."""
    kind = kind_of(path)
    if kind is None or kind.name not in names:
        what = f"a {kind.label}" if kind else "neither a model directory (model.safetensors) nor an export directory"
        raise ModelError(f"'{path}' is {what}; expected {' or '.join(n.replace('-', ' ') for n in names)}")
    return kind


def export_hook(path: str | Path) -> Callable | None:
    """The function that prepares the model at `path` and its exporter, for kinds exported their own way."""
    kind = kind_of(path)
    if kind is None or kind.exporter is None:
        return None
    module, _, name = kind.exporter.partition(":")
    return getattr(importlib.import_module(module), name)
