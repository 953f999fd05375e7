"""Quantizing one exported graph with ONNX Runtime: static int8 from calibrated ranges, dynamic or block-wise int8.

Static: a calibration statistic per graph (`StaticGraph`) folds the ranges of what the graph computes on its real
feeds as generation runs (see `calibrate.TapGraph`); its ranges are written to a calibration cache, and
`quantize_static` reads them back from that cache. Dynamic: `quantize_dynamic`, weights only, activation ranges
computed per call at run time. Block-wise: `MatMulNBits`, a scale per block of 32 input channels for weights and (at
run time) activations.
Activations are uint8 and weights int8 (U8S8), the combination ONNX Runtime's x86 kernels run fastest.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t5compress import artifacts
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


class Ranges:
    """The activation ranges of `tensors`, folded run by run (a calibration statistic, see `calibrate.TapGraph`).

    minmax: ReduceMin / ReduceMax nodes in the graph, so a run returns two numbers a tensor and the running min / max
    is all that is kept (ONNX Runtime's MinMax calibrator, without its list of every run's outputs). entropy and
    percentile: ONNX Runtime's own histogram collector with its calibrators' defaults, shown each run's tensors once.
    """

    def __init__(self, method: str, tensors: list[str], percentile: float = 99.999):
        from onnxruntime.quantization.calibrate import HistogramCollector

        self.method, self.tensors = method, list(tensors)
        self.lo: dict[str, np.ndarray] = {}
        self.hi: dict[str, np.ndarray] = {}
        self.collector = None
        if method == "entropy":
            self.collector = HistogramCollector("entropy", False, 128, 128, percentile, "same")
        elif method == "percentile":
            self.collector = HistogramCollector("percentile", True, 2048, 128, percentile, "same")

    def augment(self, model) -> list[str]:
        from onnx import helper

        if self.collector is not None:
            return list(self.tensors)
        wanted = set(self.tensors)

        def reduce(tensors) -> list:
            return [helper.make_node(op, [t], [f"{t}_{op}"], keepdims=1) for t in tensors if t in wanted
                    for op in ("ReduceMin", "ReduceMax")]

        # each reduction right after what it reads: ONNX Runtime runs nodes in about this order and frees a tensor
        # after its last reader, so reductions at the end kept every activation of the graph alive at once
        nodes = reduce(i.name for i in model.graph.input)
        for node in model.graph.node:
            nodes += [node, *reduce(node.output)]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        return [f"{t}_{op}" for t in self.tensors for op in ("ReduceMin", "ReduceMax")]

    def __call__(self, feeds: dict[str, np.ndarray], values: dict[str, np.ndarray]) -> None:
        if self.collector is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per call
                self.collector.collect({t: [values[t]] for t in self.tensors})
            return
        for t in self.tensors:
            lo, hi = np.nanmin(values[t + "_ReduceMin"]), np.nanmax(values[t + "_ReduceMax"])
            self.lo[t] = np.fmin(self.lo[t], lo) if t in self.lo else lo
            self.hi[t] = np.fmax(self.hi[t], hi) if t in self.hi else hi

    def result(self):
        """ONNX Runtime's TensorsData, as its calibrators' `compute_data` gives it."""
        from onnxruntime.quantization.calibrate import TensorsData

        method = _calibration_methods()[self.method]
        if self.collector is not None:
            return TensorsData(method, self.collector.compute_collection_result())
        return TensorsData(method, {t: (np.array([self.lo[t]]), np.array([self.hi[t]])) for t in self.lo})


def calibrated_tensors(model, plan: Plan) -> list[str]:
    """The float activations every node of the plan's op types reads and writes, as ONNX Runtime's calibrators pick
    them (attention's own products included), so the ranges, and the int8 graphs written from them, are those its
    calibrators gave (checked on the demo fixture: every range within 2.4e-6). Types come from ONNX shape inference
    over the graph's structure (its weights as typed inputs, not loaded)."""
    import onnx
    from onnx import helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    light = helper.make_model(helper.make_graph(
        list(g.node), "types", [*g.input, *(helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                                            for t in inits.values())], list(g.output)),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inferred = onnx.shape_inference.infer_shapes(light)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *g.input, *g.output)}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    out = []
    for node in g.node:
        if node.op_type in plan.op_types:
            out += [t for t in (*node.input, *node.output) if t and t not in inits and types.get(t) in floats]
    return list(dict.fromkeys(out))


class StaticGraph:
    """Collects activation ranges of one graph from its runs (a calibration statistic), then writes the static int8
    graph."""

    def __init__(self, graph, plan: Plan, method: str, work: Path, percentile: float = 99.999):
        """`graph`: a `sources.Graph` (its file and its structure)."""
        self.graph, self.src, self.plan, self.method, self.work = graph, graph.path, plan, method, work
        try:
            tensors = calibrated_tensors(graph.model, plan)
        except Exception as e:  # onnx's own types
            raise QuantizeError(f"cannot prepare calibration of {graph.path.name}: {first_line(e)}") from e
        self.ranges = Ranges(method, tensors, percentile)
        self.feeds = 0
        self.cache: Path | None = None

    def augment(self, model) -> list[str]:
        return self.ranges.augment(model)

    def __call__(self, feeds: dict[str, np.ndarray], values: dict[str, np.ndarray]) -> None:
        self.ranges(feeds, values)
        self.feeds += 1

    def write(self, dst: Path, fmt: str, per_channel: bool, reduce_range: bool = False, plan: Plan | None = None,
              outputs: bool = True) -> None:
        """The int8 graph of `plan` (default: the one calibrated for) written to `dst`; the ranges are computed once,
        so one calibration can write several plans. `outputs=False` leaves the linear layers' outputs fp32 (ONNX
        Runtime's QDQ quantizer otherwise rounds them to uint8 too: every residual contribution, the gate's inputs,
        the logits)."""
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
            save_tensors_data(self.ranges.result(), self.cache)
        cache = self.cache
        formats = {"qdq": QuantFormat.QDQ, "qoperator": QuantFormat.QOperator}
        with _quiet():
            quantize_static(
                self.graph.in_scratch(self.work), dst, calibration_data_reader=None, calibration_cache_path=cache,
                quant_format=formats[fmt], op_types_to_quantize=list(plan.op_types), per_channel=per_channel,
                reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                nodes_to_quantize=list(plan.nodes), nodes_to_exclude=list(plan.exclude),
                calibrate_method=_calibration_methods()[self.method],
                extra_options={"MatMulConstBOnly": True, "ActivationSymmetric": False,
                               **({} if outputs else {"OpTypesToExcludeOutputQuantization": ["MatMul", "Gemm"]})},
            )

    def quantized(self, fmt: str, per_channel: bool, reduce_range: bool = False, plan: Plan | None = None,
                  outputs: bool = True):
        """`write`'s int8 graph in memory (ONNX Runtime's quantizer writes it into `work`, read back once)."""
        if (plan or self.plan).nodes or not self.feeds:
            dst = self.work / f"{self.src.stem}.int8.onnx"
            self.write(dst, fmt, per_channel, reduce_range, plan, outputs)
            return _parsed(dst)
        return self.graph.weights()


def dynamic_int8(graph, work: Path, plan: Plan, per_channel: bool, reduce_range: bool = False):
    """Dynamic int8 of `graph` (a `sources.Graph`), in memory: int8 weights on disk, uint8 activations quantized per
    call (7-bit weights if `reduce_range`). ONNX Runtime's quantizer writes it into `work`, read back once."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if not plan.nodes:
        return graph.weights()
    dst = work / f"{graph.path.stem}.int8.onnx"
    with _quiet():
        quantize_dynamic(
            graph.in_scratch(work), dst, op_types_to_quantize=list(plan.op_types), per_channel=per_channel,
            reduce_range=reduce_range, weight_type=QuantType.QInt8, nodes_to_quantize=list(plan.nodes),
            nodes_to_exclude=list(plan.exclude), extra_options={"MatMulConstBOnly": True},
        )
    return _parsed(dst)


def _parsed(path: Path):
    from t5compress.runtime.sessions import load_onnx

    return load_onnx(str(path))


def _unquantized(src: Path, dst: Path) -> None:
    """`src` as it is, for a plan with no node to quantize: ONNX Runtime's quantizer reads an empty nodes_to_quantize
    as every node of the op types (with the default per-token layers and fp32 embeddings, that quantized attention's
    own products, the relative position bias lookup and the value cache: next-token agreement 56% instead of 97% on
    the tiny gated test model)."""
    import onnx

    onnx.save(_parsed(src), str(dst))


def blockwise(graph, plan: Plan, block: int, rounded: dict | None = None, bits: int = 8,
              wide: frozenset[str] = frozenset()):
    """Block-wise int8 or 4-bit: each linear layer as ONNX Runtime's MatMulNBits with `bits`-bit weights (those in
    `wide` 8-bit), one scale per block of `block` input channels, and `accuracy_level` 4 (activations quantized to
    int8 per block at run time, int8 multiply-adds). `rounded`: {node name: (int (in, out), scales (in / block,
    out))}, e.g. `gptq.gptq_int8`'s with `group=block`; the other weights are rounded to nearest. The embedding
    lookups gather int8 rows, each with its own scale (`graphs.int8_row_lookups`), or at 4 bits 4-bit blocks
    (`nbits.block_lookups4`); a tied one reads the LM head's packed blocks instead (`_lookup_packed`). `graph`: a
    `sources.Graph`; returns the rewritten graph, in memory."""
    from onnx import helper, numpy_helper

    from t5compress.quantize.graphs import int8_row_lookups, sort_nodes
    from t5compress.quantize.nbits import WEIGHT_MAX, block_lookups4, lookup_packed4, pack_blocks4

    model = graph.weights()
    tied = _tied_lookups(model, plan)
    untied = set(plan.nodes) - set(tied)
    four = block_lookups4(model, untied - wide, block) if bits == 4 else set()
    int8_row_lookups(model, untied - four)
    inits = {t.name: t for t in model.graph.initializer}
    done, packed_as = [], {}
    for node in list(model.graph.node):
        weight = node.input[1] if node.op_type == "MatMul" else None
        if node.name not in plan.nodes or weight not in inits:
            continue
        width = 8 if node.name in wide else bits
        w = numpy_helper.to_array(inits[weight])
        q, scales = (rounded or {}).get(node.name) or nearest_blocks(w, block, WEIGHT_MAX[width])
        (k, n), p = w.shape, node.name.rsplit("/", 1)[0] + "/nbits_"
        packed, scales = pack_blocks4(q, scales, block) if width == 4 else pack_blocks(q, scales, block)
        model.graph.initializer.extend([numpy_helper.from_array(packed, p + "w"),
                                        numpy_helper.from_array(scales, p + "scales")])
        packed_as[weight] = (p, k, width)
        model.graph.node.append(helper.make_node(
            "MatMulNBits", [node.input[0], p + "w", p + "scales"], list(node.output), name=f"{node.name}_Q{width}",
            domain="com.microsoft", K=k, N=n, bits=width, block_size=block, accuracy_level=4))
        done.append(node.name)
    for lookup, weight in tied.items():
        if weight in packed_as:
            p, k, width = packed_as[weight]
            (lookup_packed4 if width == 4 else _lookup_packed)(model, lookup, p, k, block)
    if (done or four) and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    sort_nodes(model, set(done))
    read = _read(model.graph)  # a fp32 weight stays only where a node still reads it (a tied table under
    for t in [t for t in model.graph.initializer if t.name not in read]:  # --no-embeddings)
        model.graph.initializer.remove(t)
    return model


def _read(graph) -> set[str]:
    """The names the nodes of `graph` read, those of its subgraphs (If, Loop) included."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                names |= _read(g)
    return names


def _tied_lookups(model, plan: Plan) -> dict[str, str]:
    """{lookup node name: LM head weight} for the embedding lookups (in `plan`) that read a copy of a tied table: the
    export's (d_model, vocab) LM head matrix gathered along axis 1, copied by `graphs.untie_embeddings`."""
    weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.name in plan.nodes}
    out = {}
    for node in model.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        base = node.input[0].removesuffix("_embedding") if node.op_type == "Gather" else ""
        if node.name in plan.nodes and axis == 1 and base != node.input[0] and base in weights:
            out[node.name] = base
    return out


def _lookup_packed(model, name: str, p: str, k: int, block: int) -> None:
    """Make the tied lookup `name` read the LM head's packed MatMulNBits matrix (`p`w: (vocab, blocks, block) uint8,
    `p`scales: (vocab * blocks,)) instead of its own copy: the rows of the ids, less 128, times their blocks' scales,
    in the (d_model, batch, length) layout the Gather along axis 1 gave. The tied table is then stored once."""
    from onnx import TensorProto, helper, numpy_helper

    node = next(n for n in model.graph.node if n.name == name)
    ids, out = node.input[1], node.output[0]  # its copy of the table, read by nothing now, goes with the unread ones
    q = f"{name}_blocks"
    constants = {"_shape": np.array([-1, -(-k // block)], np.int64), "_flat": np.array([0, 0, -1], np.int64),
                 "_zero": np.array(128.0, np.float32), "_unsq": np.array([-1], np.int64),
                 "_start": np.array([0], np.int64), "_k": np.array([k], np.int64), "_axis": np.array([2], np.int64)}
    model.graph.initializer.extend(numpy_helper.from_array(v, q + key) for key, v in constants.items())
    model.graph.node.remove(node)
    model.graph.node.extend([
        helper.make_node("Gather", [p + "w", ids], [q + "_rows"], name=q + "_Gather", axis=0),  # (b, l, blocks, block)
        helper.make_node("Cast", [q + "_rows"], [q + "_float"], name=q + "_Cast", to=TensorProto.FLOAT),
        helper.make_node("Sub", [q + "_float", q + "_zero"], [q + "_int"], name=q + "_Sub"),
        helper.make_node("Reshape", [p + "scales", q + "_shape"], [q + "_scales2d"], name=q + "_scales_Reshape"),
        helper.make_node("Gather", [q + "_scales2d", ids], [q + "_picked"], name=q + "_scales_Gather", axis=0),
        helper.make_node("Unsqueeze", [q + "_picked", q + "_unsq"], [q + "_scale"], name=q + "_Unsqueeze"),
        helper.make_node("Mul", [q + "_int", q + "_scale"], [q + "_values"], name=q + "_Mul"),
        helper.make_node("Reshape", [q + "_values", q + "_flat"], [q + "_padded"], name=q + "_Reshape"),
        helper.make_node("Slice", [q + "_padded", q + "_start", q + "_k", q + "_axis"], [q + "_rows_d"],
                         name=q + "_Slice"),  # blocks of the last one past d_model are padding
        helper.make_node("Transpose", [q + "_rows_d"], [out], name=q + "_Transpose", perm=[2, 0, 1]),
    ])


def nearest_blocks(w: np.ndarray, block: int, weight_max: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """w (in, out) rounded to nearest with a scale per `block` input channels of each output channel: (int8 (in, out),
    scales (ceil(in / block), out), max |w| / weight_max of each block). `block` = in: a scale per output channel."""
    blocks = -(-w.shape[0] // block)
    padded = np.zeros((blocks * block, w.shape[1]), np.float32)
    padded[: w.shape[0]] = w
    scales = (np.maximum(np.abs(padded.reshape(blocks, block, -1)).max(axis=1), 1e-12) / weight_max).astype(np.float32)
    q = np.clip(np.round(padded / np.repeat(scales, block, axis=0)), -weight_max, weight_max)[: w.shape[0]]
    return q.astype(np.int8), scales


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


def scratch_dir(near: Path):
    """A scratch folder on the output's file system (augmented calibration graphs can be large); a later run removes
    it if this one is killed."""
    return artifacts.scratch_dir(near, ".quantize.")
