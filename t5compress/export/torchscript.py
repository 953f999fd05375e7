"""TorchScript export: `torch.jit.trace` of the same wrappers the ONNX export uses.

Each `<name>.pt` takes its inputs positionally in the graph's declared input order and returns a tuple in the
declared output order (see `t5compress.export.graphs`), so a caller can zip the outputs with the ONNX names.
torch 2.13 marks `torch.jit` deprecated (in favour of torch.export); TorchScript stays because users deploy it, and
the notices are silenced around our own calls only.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from t5compress.errors import ExportError, first_line
from t5compress.export.graphs import GraphSpec
from t5compress.names import TORCHSCRIPT_SUFFIX

log = logging.getLogger(__name__)


class _TupleOut(torch.nn.Module):
    """Makes every traced graph return a tuple, even the encoder's single output, so callers never special-case."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.inner(*args)
        return out if isinstance(out, tuple) else (out,)


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch.jit's deprecation notices and TracerWarnings for the calls inside only (not process-wide)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


def trace_graph(model: torch.nn.Module, spec: GraphSpec) -> torch.jit.ScriptModule:
    """Trace `spec`'s wrapper of `model` on its dummy inputs."""
    wrapper = _TupleOut(spec.wrap(model)).eval()
    try:
        # TracerWarnings flag the Python branches of transformers' cache code; verification on other shapes is what
        # proves the trace general, so they are noise to users (silenced here only, not process-wide).
        with torch.no_grad(), quiet_jit():
            # check_trace re-runs the same inputs only; verification checks other shapes, which is what matters.
            return torch.jit.trace(wrapper, spec.dummy_inputs(model.config), check_trace=False, strict=False)
    except Exception as e:  # the tracer raises many types; the user needs one line naming the graph
        raise ExportError(f"TorchScript trace of {spec.name} failed: {first_line(e)}") from e


def export_torchscript(model: torch.nn.Module, specs: dict[str, GraphSpec], out: Path) -> dict[str, list[Path]]:
    """Trace every graph in `specs` and save it as `out/<name>.pt`."""
    files = {}
    for name, spec in specs.items():
        log.info("tracing %s", name)
        path = out / f"{name}{TORCHSCRIPT_SUFFIX}"
        module = trace_graph(model, spec)
        with quiet_jit():
            torch.jit.save(module, str(path))
        files[name] = [path]
    return files
