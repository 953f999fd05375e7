"""Quantizing one exported graph with ONNX Runtime: static int8 from calibrated ranges, dynamic or block-wise int8.

Static: a calibrator per graph (`StaticGraph`) receives the graph's real feeds one at a time (see `calibrate.Tap`),
its ranges are written to a calibration cache, and `quantize_static` reads them back from that cache. Dynamic:
`quantize_dynamic`, weights only, activation ranges computed per call at run time. Block-wise: `MatMulNBits`, a
scale per block of 32 input channels for weights and (at run time) activations.
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
        if not plan.nodes:
            _unquantized(self.src, dst)
            return
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

    if not plan.nodes:
        _unquantized(src, dst)
        return
    with _quiet():
        quantize_dynamic(
            src, dst, op_types_to_quantize=list(plan.op_types), per_channel=per_channel, reduce_range=reduce_range,
            weight_type=QuantType.QInt8, nodes_to_quantize=list(plan.nodes), nodes_to_exclude=list(plan.exclude),
            extra_options={"MatMulConstBOnly": True},
        )


def _unquantized(src: Path, dst: Path) -> None:
    """`src` as it is, for a plan with no node to quantize: ONNX Runtime's quantizer reads an empty nodes_to_quantize
    as every node of the op types (with the default per-token layers and fp32 embeddings, that quantized attention's
    own products, the relative position bias lookup and the value cache: next-token agreement 56% instead of 97% on
    the tiny gated test model)."""
    import onnx

    from t5compress.runtime.sessions import load_onnx

    onnx.save(load_onnx(str(src)), str(dst))


BLOCK = 32  # blockwise: weights and activations get a scale per 32 input channels (95.4% of held-out outputs kept on
# the gated fixture, benchmarks/results/int8_gated.md; blocks of 128 kept 94.0%, docs/quantize.md)


def write_blockwise(src: Path, dst: Path, plan: Plan) -> None:
    """Block-wise int8: each linear layer as ONNX Runtime's MatMulNBits with 8-bit weights, one scale per block of
    `BLOCK` input channels, and `accuracy_level` 4 (activations quantized to int8 per block at run time, int8
    multiply-adds). The embedding lookups gather int8 rows, each with its own scale (`graphs.int8_row_lookups`)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    linear = sorted(n.name for n in model.graph.node if n.op_type == "MatMul" and n.name in plan.nodes)
    from t5compress.quantize.graphs import int8_row_lookups

    int8_row_lookups(model, set(plan.nodes))
    with _quiet():
        quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=BLOCK, is_symmetric=True, accuracy_level=4,
                                         nodes_to_include=linear)
        quantizer.process()
    onnx.save(quantizer.model.model, str(dst))


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
