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


def write_blockwise(src: Path, dst: Path, plan: Plan, block: int, rounded: dict | None = None) -> None:
    """Block-wise int8: each linear layer as ONNX Runtime's MatMulNBits with 8-bit weights, one scale per block of
    `block` input channels, and `accuracy_level` 4 (activations quantized to int8 per block at run time, int8
    multiply-adds). `rounded`: {node name: (int8 (in, out), scales (in / block, out))}, e.g. `gptq.gptq_int8`'s with
    `group=block`; the other weights are rounded to nearest. The embedding lookups gather int8 rows, each with its own
    scale (`graphs.int8_row_lookups`)."""
    import onnx
    from onnx import helper, numpy_helper

    from t5compress.quantize.graphs import graph_index, int8_row_lookups, sort_nodes

    model = onnx.load(str(src))
    int8_row_lookups(model, set(plan.nodes))
    inits, _, users = graph_index(model)
    done = []
    for node in list(model.graph.node):
        weight = node.input[1] if node.op_type == "MatMul" else None
        if node.name not in plan.nodes or weight not in inits or users.get(weight, 0) != 1:
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        q, scales = (rounded or {}).get(node.name) or nearest_blocks(w, block)
        (k, n), p = w.shape, node.name.rsplit("/", 1)[0] + "/nbits_"
        packed, scales = pack_blocks(q, scales, block)
        model.graph.initializer.extend([numpy_helper.from_array(packed, p + "w"),
                                        numpy_helper.from_array(scales, p + "scales")])
        model.graph.initializer.remove(inits[node.input[1]])
        model.graph.node.append(helper.make_node(
            "MatMulNBits", [node.input[0], p + "w", p + "scales"], list(node.output), name=node.name + "_Q8",
            domain="com.microsoft", K=k, N=n, bits=8, block_size=block, accuracy_level=4))
        done.append(node.name)
    if done and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    sort_nodes(model, set(done))
    onnx.save(model, str(dst))


def nearest_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """w (in, out) rounded to nearest with a scale per `block` input channels of each output channel: (int8 (in, out),
    scales (ceil(in / block), out), max |w| / 127 of each block)."""
    blocks = -(-w.shape[0] // block)
    padded = np.zeros((blocks * block, w.shape[1]), np.float32)
    padded[: w.shape[0]] = w
    scales = np.maximum(np.abs(padded.reshape(blocks, block, -1)).max(axis=1), 1e-12) / 127  # (blocks, out)
    q = np.clip(np.round(padded / np.repeat(scales, block, axis=0)), -127, 127)[: w.shape[0]]
    return q.astype(np.int8), scales.astype(np.float32)


def pack_blocks(q: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 (in, out) and scales (blocks, out) -> MatMulNBits' B (out, blocks, block) uint8, the int8 values + 128
    (its default zero point for 8 bits), zero-padded past `in`, and its scales (out * blocks,) float32."""
    blocks = scales.shape[0]
    padded = np.zeros((blocks * block, q.shape[1]), np.int16)
    padded[: q.shape[0]] = q
    packed = (padded.T.reshape(q.shape[1], blocks, block) + 128).astype(np.uint8)
    return packed, np.ascontiguousarray(scales.T, dtype=np.float32).reshape(-1)


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
