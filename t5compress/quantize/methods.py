"""Quantizing one exported graph with ONNX Runtime: static int8 from calibrated ranges, or dynamic int8.

Static: a calibrator per graph (`StaticGraph`) receives the graph's real feeds one at a time (see `calibrate.Tap`),
its ranges are written to a calibration cache, and `quantize_static` reads them back from that cache. Dynamic:
`quantize_dynamic`, weights only, activation ranges computed per call at run time.
Activations are uint8 and weights int8 (U8S8), the combination ONNX Runtime's x86 kernels run fastest.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t5compress.errors import QuantizeError, first_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What to quantize in one graph: node names in, node names kept fp32, the op types involved."""

    nodes: tuple[str, ...]
    exclude: tuple[str, ...]
    op_types: tuple[str, ...]


def _calibration_methods():
    from onnxruntime.quantization import CalibrationMethod

    return {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}


CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
FORMATS = ("qdq", "qoperator")


class _OneFeed:
    """A CalibrationDataReader over a single feed: each calibrator call sees one real input, whatever its shape."""

    def __init__(self, feeds: dict[str, np.ndarray]):
        self._feeds: list[dict[str, np.ndarray]] | None = [feeds]

    def get_next(self):
        return self._feeds.pop() if self._feeds else None


class StaticGraph:
    """Collects activation ranges of one graph from its feeds, then writes the static int8 graph."""

    def __init__(self, src: Path, plan: Plan, method: str, work: Path, percentile: float = 99.999):
        from onnxruntime.quantization import create_calibrator

        self.src, self.plan, self.method, self.work = src, plan, method, work
        options = {"percentile": percentile} if method == "percentile" else {}
        try:
            self.calibrator = create_calibrator(
                src, list(plan.op_types), augmented_model_path=str(work / f"{src.stem}.augmented.onnx"),
                calibrate_method=_calibration_methods()[method], extra_options=options,
            )
        except Exception as e:  # onnxruntime's own types
            raise QuantizeError(f"cannot prepare calibration of {src.name}: {first_line(e)}") from e
        self.feeds = 0
        self.cache: Path | None = None

    def __call__(self, feeds: dict[str, np.ndarray]) -> None:
        self.calibrator.collect_data(_OneFeed(feeds))
        self.feeds += 1

    def write(self, dst: Path, fmt: str, per_channel: bool, reduce_range: bool = False, plan: Plan | None = None,
              outputs: bool = True) -> None:
        """The int8 graph of `plan` (default: the one calibrated for); the ranges are computed once, so one
        calibration can write several plans. `outputs=False` leaves the linear layers' outputs fp32 (ONNX Runtime's
        QDQ quantizer otherwise rounds them to uint8 too: every residual contribution, the gate's inputs, the
        logits)."""
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
        from onnxruntime.quantization.calibrate import save_tensors_data

        if not self.feeds:
            raise QuantizeError(f"{self.src.name} saw no calibration input; give more calibration texts")
        plan = plan or self.plan
        if self.cache is None:
            self.cache = self.work / f"{self.src.stem}.ranges.json"
            save_tensors_data(self.calibrator.compute_data(), self.cache)
        cache = self.cache
        formats = {"qdq": QuantFormat.QDQ, "qoperator": QuantFormat.QOperator}
        with _quiet():
            quantize_static(
                self.src, dst, calibration_data_reader=None, calibration_cache_path=cache,
                quant_format=formats[fmt], op_types_to_quantize=list(plan.op_types), per_channel=per_channel,
                reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                nodes_to_quantize=list(plan.nodes), nodes_to_exclude=list(plan.exclude),
                calibrate_method=_calibration_methods()[self.method],
                extra_options={"MatMulConstBOnly": True, "ActivationSymmetric": False,
                               **({} if outputs else {"OpTypesToExcludeOutputQuantization": ["MatMul", "Gemm"]})},
            )


def write_dynamic(src: Path, dst: Path, plan: Plan, per_channel: bool, reduce_range: bool = False) -> None:
    """Dynamic int8: int8 weights on disk, uint8 activations quantized per call (7-bit weights if `reduce_range`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(
            src, dst, op_types_to_quantize=list(plan.op_types), per_channel=per_channel, reduce_range=reduce_range,
            weight_type=QuantType.QInt8, nodes_to_quantize=list(plan.nodes), nodes_to_exclude=list(plan.exclude),
            extra_options={"MatMulConstBOnly": True},
        )


class _quiet:
    """ONNX Runtime's quantizer logs advice about pre-processing at WARNING through the root logger; hide it here."""

    def __enter__(self):
        self.level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger().setLevel(self.level)


def scratch_dir(near: Path) -> tempfile.TemporaryDirectory:
    """A scratch folder on the output's file system (augmented calibration graphs can be large)."""
    return tempfile.TemporaryDirectory(prefix=".quantize.", dir=os.fspath(near))
