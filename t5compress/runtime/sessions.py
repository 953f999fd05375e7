"""Backends that run the three exported graphs: ONNX Runtime sessions, or TorchScript modules.

Both expose the same small interface (`Graph`: input and output names, `run(feeds) -> {name: array}`), so the
generation code never knows which one it drives. Only the TorchScript backend imports torch, and only when opened:
the ONNX path needs numpy and onnxruntime alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from t5compress.errors import ModelError, first_line
from t5compress.names import (
    GRAPHS,
    MANIFEST_FILE,
    ONNX_SUFFIX,
    TORCHSCRIPT_SUFFIX,
    graph_io,
)

log = logging.getLogger(__name__)

FORMAT_SUFFIXES = {"onnx": ONNX_SUFFIX, "torchscript": TORCHSCRIPT_SUFFIX}


class Graph(Protocol):
    """One exported graph: named numpy inputs in, named numpy outputs out."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Backend:
    """The three graphs of an export directory, opened and ready to run."""

    format: str
    encoder: Graph
    decoder: Graph  # first step: no past in, full cache (self + cross attention) out
    decoder_with_past: Graph  # later steps: one token and the cache in, the grown self-attention cache out


def _feeds_for(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The arrays `graph` declares, in its order; a missing one is an export the runtime does not understand."""
    try:
        return [feeds[n] for n in graph.input_names]
    except KeyError as e:
        raise ModelError(
            f"graph '{graph.name}' needs input {e.args[0]!r}, which the runtime does not provide: "
            f"not an encoder/decoder/decoder-with-past export in optimum's naming"
        ) from None


class OnnxGraph:
    """An ONNX Runtime session fed only the inputs it declares, with outputs mapped by name."""

    def __init__(self, path: Path, threads: int, providers: Sequence[str] | None = None):
        import onnxruntime as ort

        self.name = path.stem
        try:
            self.session = ort.InferenceSession(
                str(path), sess_options=session_options(threads), providers=list(providers or ["CPUExecutionProvider"])
            )
        except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            raise ModelError(f"cannot load '{path}' with ONNX Runtime: {first_line(e)}") from e
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(None, dict(zip(self.input_names, _feeds_for(self, feeds), strict=True)))
        return dict(zip(self.output_names, values, strict=True))


def session_options(threads: int):
    """Pinned, non-spinning threads: on 2-vCPU machines a spinning pool steals the core the other thread needs."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(threads, 0)  # 0: ONNX Runtime's default (one per physical core)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3  # warnings about unused initializers etc. are noise for users of an export dir
    return so


class TorchScriptGraph:
    """A TorchScript module fed the ONNX graph's inputs positionally; its output tuple is in the ONNX output order."""

    def __init__(self, path: Path, input_names: Sequence[str], output_names: Sequence[str]):
        import torch

        self.name = path.stem
        self._torch = torch
        try:
            self.module = torch.jit.load(str(path), map_location="cpu").eval()
        except (RuntimeError, OSError, ValueError) as e:
            raise ModelError(f"cannot load '{path}' as TorchScript: {first_line(e)}") from e
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [self._torch.from_numpy(np.ascontiguousarray(a)) for a in _feeds_for(self, feeds)]
        with self._torch.inference_mode():
            out = self.module(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        if len(out) != len(self.output_names):
            raise ModelError(f"graph '{self.name}' returned {len(out)} outputs, expected {len(self.output_names)}")
        return {n: t.numpy() for n, t in zip(self.output_names, out, strict=True)}


def detect_format(path: str | Path) -> str:
    """'onnx' or 'torchscript'; a ModelError naming the missing graph files for anything else."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"'{p}' is not a directory; pass an export directory (t5compress export MODEL OUT --onnx)")
    partial = None
    for fmt, suffix in FORMAT_SUFFIXES.items():
        missing = [f"{g}{suffix}" for g in GRAPHS if not (p / f"{g}{suffix}").is_file()]
        if not missing:
            return fmt
        if len(missing) < len(GRAPHS) and partial is None:
            partial = missing
    if partial:
        raise ModelError(f"'{p}' is an incomplete export directory: missing {', '.join(partial)}")
    wanted = ", ".join(f"{g}{ONNX_SUFFIX}" for g in GRAPHS)
    raise ModelError(f"'{p}' is not an export directory: missing {wanted} (or the {TORCHSCRIPT_SUFFIX} files)")


def open_onnx(path: Path, threads: int, providers: Sequence[str] | None = None) -> Backend:
    enc, dec, past = (OnnxGraph(path / f"{g}{ONNX_SUFFIX}", threads, providers) for g in GRAPHS)
    return Backend("onnx", enc, dec, past)


def open_torchscript(path: Path, threads: int, providers: Sequence[str] | None = None) -> Backend:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)  # process-wide in torch: there is no per-module setting
    names = torchscript_io_names(path)
    graphs = [TorchScriptGraph(path / f"{g}{TORCHSCRIPT_SUFFIX}", *names[g]) for g in GRAPHS]
    return Backend("torchscript", *graphs)


def torchscript_io_names(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Positional input names and output names per graph: the export's `graphs.json`, else `names.graph_io`."""
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
            return {g: (list(data[g]["inputs"]), list(data[g]["outputs"])) for g in GRAPHS}
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"'{manifest}' does not list inputs and outputs of {', '.join(GRAPHS)}: {e}") from None
    return {g: (list(ins), list(outs)) for g, (ins, outs) in graph_io(_decoder_layers(path)).items()}


def _decoder_layers(path: Path) -> int:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"'{path}' has no readable config.json: {e}") from None
    return int(cfg.get("num_decoder_layers") or cfg["num_layers"])


BACKENDS: dict[str, Callable[..., Backend]] = {"onnx": open_onnx, "torchscript": open_torchscript}


def open_backend(path: str | Path, threads: int = 1, providers: Sequence[str] | None = None) -> Backend:
    """Open the graphs of an ONNX or TorchScript export directory."""
    p = Path(path)
    fmt = detect_format(p)
    log.info("opening %s export %s with %d thread(s)", fmt, p, threads)
    return BACKENDS[fmt](p, threads, providers)
