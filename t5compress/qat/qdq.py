"""ONNX QuantizeLinear/DequantizeLinear graphs from a QAT dir's learned scales (no recalibration).

The fp32 graphs are exported as usual (the one `torch.onnx.export` call site), then rewritten:
- each MatMul whose weight is a quantized Linear's (matched by content: the exporter stores W^T under generated
  names) gets an int8 initializer (in, out) with per-column scales and a DequantizeLinear (axis 1), and its input a
  QuantizeLinear -> DequantizeLinear pair (uint8, the learned scale and zero point), one pair per input tensor and
  activation quantizer, so q/k/v share theirs;
- each Gather of the quantized embedding table reads an int8 table and multiplies the gathered rows by their scales.
The numbers are exactly the fake-quant model's (same rounding, same scales), so the check is against that model.
ONNX Runtime fuses DequantizeLinear -> MatMul into MatMulIntegerToFloat (u8 activations x s8 weights, VNNI on x86).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t5compress.errors import ConfigError, ExportError
from t5compress.names import ONNX_SUFFIX
from t5compress.runtime.sessions import load_onnx, onnx_session

log = logging.getLogger(__name__)

INT8_KERNELS = ("MatMulIntegerToFloat", "MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul")


@dataclass
class _Linear:
    name: str
    qweight_t: np.ndarray  # (in, out) int8
    scale: np.ndarray  # (out,) float32
    act: object | None  # the ActQuant (shared by layers that read the same tensor)
    act_scale: np.ndarray | None = None
    act_zero_point: np.ndarray | None = None


@dataclass
class _Embedding:
    name: str
    qtable: np.ndarray  # (vocab, d_model) int8
    scale: np.ndarray  # (vocab, 1) float32


def _key(a: np.ndarray) -> bytes:
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()).digest()


def weight_table(model) -> dict[bytes, _Linear | _Embedding]:
    """fp32 weight content as the exporter writes it (W^T for MatMul, W for Gather) -> what replaces it."""
    from t5compress.qat.fakequant import QuantLinear, quant_layers, quantize_weight

    table: dict[bytes, _Linear | _Embedding] = {}
    for name, m in quant_layers(model).items():
        q, s = quantize_weight(m.weight, m.w_max)
        w = m.weight.detach().float().numpy()
        if isinstance(m, QuantLinear):
            table[_key(w.T)] = _Linear(
                name, q.numpy().T.copy(), s.numpy().astype(np.float32), m.act,
                np.array(float(m.act.scale().detach()), np.float32),
                np.array(int(m.act.zero_point), np.uint8),
            )
        else:
            table[_key(w)] = _Embedding(name, q.numpy(), s.numpy().astype(np.float32)[:, None])
    return table


def quantize_graph(proto, table: dict[bytes, _Linear | _Embedding]) -> dict:
    """Rewrite the fp32 `proto` in place into Q/DQ form; returns counts of what was rewritten."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    keys = {name: _key(numpy_helper.to_array(t)) for name, t in inits.items() if t.data_type == 1 and t.dims}
    added: list = []
    act_out: dict[tuple[str, int], str] = {}
    nodes, stats = [], {"matmul_int8": 0, "gather_int8": 0, "activation_qdq": 0}
    found: set[str] = set()

    def init(array: np.ndarray, name: str) -> str:
        added.append(numpy_helper.from_array(array, name))
        return name

    for node in graph.node:
        entry = table.get(keys.get(node.input[1] if len(node.input) > 1 else "", b""))
        if node.op_type == "MatMul" and isinstance(entry, _Linear):
            w = node.input[1]
            nodes.append(helper.make_node(
                "DequantizeLinear",
                [init(entry.qweight_t, f"{w}_quantized"), init(entry.scale, f"{w}_scale"),
                 init(np.zeros(entry.scale.shape, np.int8), f"{w}_zero_point")],
                [f"{w}_dequantized"], name=f"{w}_DequantizeLinear", axis=1,
            ))
            node.input[1] = f"{w}_dequantized"
            x, k = node.input[0], (node.input[0], id(entry.act))
            if k not in act_out:
                n = len(act_out)
                s, z = init(entry.act_scale, f"act{n}_scale"), init(entry.act_zero_point, f"act{n}_zero_point")
                nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"act{n}_quantized"], name=f"act{n}_Q"))
                nodes.append(helper.make_node("DequantizeLinear", [f"act{n}_quantized", s, z], [f"act{n}_dq"],
                                              name=f"act{n}_DQ"))
                act_out[k] = f"act{n}_dq"
                stats["activation_qdq"] += 1
            node.input[0] = act_out[k]
            stats["matmul_int8"] += 1
            found.add(entry.name)
        entry = table.get(keys.get(node.input[0] if node.input else "", b""))
        if node.op_type == "Gather" and isinstance(entry, _Embedding):
            t, ids, out = node.input[0], node.input[1], node.output[0]
            q, s = init(entry.qtable, f"{t}_quantized"), init(entry.scale, f"{t}_row_scale")
            nodes += [
                helper.make_node("Gather", [q, ids], [f"{out}_int8"], name=f"{node.name}_int8"),
                helper.make_node("Cast", [f"{out}_int8"], [f"{out}_float"], to=1, name=f"{node.name}_cast"),
                helper.make_node("Gather", [s, ids], [f"{out}_scale"], name=f"{node.name}_scale"),
                helper.make_node("Mul", [f"{out}_float", f"{out}_scale"], [out], name=f"{node.name}_dequantize"),
            ]
            stats["gather_int8"] += 1
            found.add(entry.name)
            continue
        nodes.append(node)
    used = {x for n in nodes for x in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in added if t.name in used])
    return {**stats, "layers": sorted(found)}


def quantize_file(path: Path, table: dict, external: bool) -> dict:

    from t5compress.export.onnx import save_onnx

    proto = load_onnx(str(path))
    stats = quantize_graph(proto, table)
    for extra in path.parent.glob(path.name + "_data"):
        extra.unlink()  # the fp32 external data, replaced below
    save_onnx(proto, path, external)
    return stats


def ort_kernels(path: Path) -> dict[str, int]:
    """Op types of ONNX Runtime's optimised CPU graph (what the runtime runs): counts of the int8 kernels."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # portable; ALL adds layouts
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.log_severity_level = 3
        onnx_session(path, so)
        ops = [n.op_type for n in load_onnx(so.optimized_model_filepath).graph.node]
    counts = {op: ops.count(op) for op in (*INT8_KERNELS, "MatMul", "QuantizeLinear", "DequantizeLinear")}
    return {k: v for k, v in counts.items() if v}


def prepare_export(src: str | Path, model):
    """The QAT dir's hook for `export` (registered in `t5compress.kinds`): the model with its learned fake
    quantization, and the exporter that writes Q/DQ graphs from it."""
    from t5compress.qat.fakequant import load_fake_quant

    return load_fake_quant(src, model), export_qdq_dir


def export_qdq_dir(model, specs: dict, out: Path, cfg) -> dict:
    """The ONNX exporter for a QAT dir: fp32 graphs, rewritten to Q/DQ with the learned scales, verified against
    the fake-quant `model` within `cfg.int8_rtol` of the logits' scale; returns the report section."""
    from t5compress.export.onnx import export_onnx, needs_external_data, optimize_onnx, parameter_bytes, write_merged
    from t5compress.export.verify import open_onnx
    from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST
    from t5compress.qat.fakequant import plain_modules
    from t5compress.qat.qdq_check import check

    if cfg.format != "onnx":
        raise ConfigError(f"a QAT dir exports to ONNX Q/DQ graphs only, not {cfg.format}: use --onnx")
    external = needs_external_data(parameter_bytes(model), cfg.external_data_threshold)
    with plain_modules(model):
        export_onnx(model, specs, out, cfg.opset, external, share_tied=False)
    table = weight_table(model)
    rewritten = {name: quantize_file(out / f"{name}{ONNX_SUFFIX}", table, external) for name in specs}
    missing = {e.name for e in table.values()} - {n for r in rewritten.values() for n in r.pop("layers")}
    if missing:  # e.g. an exporter that writes a layer as Gemm, or a graph the weights do not match
        raise ExportError(f"int8 export: no ONNX node found for quantized layer(s) {sorted(missing)[:3]}; "
                          "nothing was written")
    names = list(specs)
    if cfg.layout != "separate":
        write_merged(out, external)
        names.append(DECODER_MERGED)
    what = "QAT int8 ONNX export"
    section: dict = {"opset": cfg.opset, "external_data": external, "graphs": names}
    section["parity"] = check(model, open_onnx(out, names), cfg.int8_rtol, cfg.max_new_tokens, what)
    if cfg.optimize:
        for name in names:
            optimize_onnx(out / f"{name}{ONNX_SUFFIX}", cfg.optimize_level, external)
        section["parity_unoptimized"] = section["parity"]
        section["parity"] = check(model, open_onnx(out, names), cfg.int8_rtol, cfg.max_new_tokens,
                                  f"{what} optimised ({cfg.optimize_level})")
    kernels = {name: ort_kernels(out / f"{name}{ONNX_SUFFIX}") for name in specs}
    section["int8"] = {"rewritten": rewritten, "ort_kernels": kernels}
    if cfg.layout == "merged":  # checked through the separate decoders above; the dir keeps the merged one alone
        for name in (DECODER, DECODER_WITH_PAST):
            for f in out.glob(f"{name}{ONNX_SUFFIX}*"):
                f.unlink()
        names = [n for n in names if n not in (DECODER, DECODER_WITH_PAST)]
        section["graphs"] = names
    log.info("%s: %s", what, rewritten)
    return section
