"""Per-token int8 for the linear layers whose inputs a static scale cannot hold: T5 v1.1 / Flan's FFN output `wo`
and an untied LM head.

Static int8 gives each activation tensor one scale, fixed at calibration. The inputs of `wo` and of an untied LM
head vary by orders of magnitude from token to token, so one scale sized for the largest rounds the others coarsely:
on the gated test fixture the LM head alone, static int8, lowered next-token agreement from 99.7% to 98.6%. Here
each row (token) of the input gets its own scale at run time, and the weight one per output channel:

    s = max|x_row| / 127                      (rows,)          ReduceMax
    x_q = round(x / s) + 128 in uint8                          QuantizeLinear, per row (axis 0)
    y = ((x_q - 128) @ W_q) * s[:, None] * w_scale             MatMulInteger, Cast, Mul

The weights are stored int8, as in static int8 (the same size). The activations are uint8 around 128 rather than
int8: ONNX Runtime's fast x86 kernels are u8 x s8 (int8 x int8 made flan-t5-small's steps 4x slower here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from t5compress.quantize.graphs import graph_index, save_without
from t5compress.runtime.sessions import load_onnx


def per_token_int8(path: Path, names: list[str], weight_max: int = 127) -> list[str]:
    """Rewrite the fp32 MatMul nodes `names` of the graph at `path` (in place) as per-token int8; returns those
    rewritten (a node already quantized, or whose weight another node shares, is left)."""
    model = load_onnx(str(path))
    inits, _, users = graph_index(model)
    done = []
    for node in list(model.graph.node):
        weight = node.input[1] if node.op_type == "MatMul" else None
        if node.name not in names or weight not in inits or users.get(weight, 0) != 1:
            continue
        model.graph.node.extend(_subgraph(model, node, numpy_helper.to_array(inits[weight]), weight_max))
        model.graph.initializer.remove(inits[weight])
        done.append(node.name)
    if done:
        save_without(model, set(done), path)
    return done


def _subgraph(model: onnx.ModelProto, node, w: np.ndarray, weight_max: int) -> list:
    """The nodes (and, added to `model`, the initializers) computing `node`'s output per token in int8."""
    x, y, w = node.input[0], node.output[0], w.astype(np.float32)  # w: (d_in, d_out)
    p = node.name.rsplit("/", 1)[0] + "/per_token_"
    w_scale = (np.maximum(np.abs(w).max(axis=0), 1e-12) / weight_max).astype(np.float32)  # (d_out,)
    consts = {"w_int8": np.clip(np.round(w / w_scale), -weight_max, weight_max).astype(np.int8), "w_scale": w_scale,
              "rows_shape": np.array([-1, w.shape[0]], np.int64), "int8_max": np.array([127.0], np.float32),
              "tiny": np.array([1e-12], np.float32), "axis_last": np.array([-1], np.int64),
              "first": np.array([0], np.int64), "d_out": np.array([w.shape[1]], np.int64),
              "offset": np.array([128.0], np.float32), "zero_point": np.array(128, np.uint8)}
    model.graph.initializer.extend(numpy_helper.from_array(v, p + k) for k, v in consts.items())

    def op(kind: str, inputs: list[str], out: str, **attrs):
        return helper.make_node(kind, [i if i == x else p + i for i in inputs], [y if out == y else p + out],
                                name=p + out.rsplit("/", 1)[-1], **attrs)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    reduce_max = (op("ReduceMax", ["x_abs", "axis_last"], "x_max", keepdims=0) if opset >= 18 else
                  op("ReduceMax", ["x_abs"], "x_max", axes=[-1], keepdims=0))  # axes became an input in opset 18
    return [
        op("Reshape", [x, "rows_shape"], "x_rows"),  # (batch, len, d_in) -> (rows, d_in)
        op("Abs", ["x_rows"], "x_abs"),
        reduce_max,
        op("Div", ["x_max", "int8_max"], "x_scale_raw"),
        op("Max", ["x_scale_raw", "tiny"], "x_scale"),  # an all-zero row keeps a usable scale
        op("Sub", ["x_scale", "x_scale"], "zeros"),  # (rows,): the per-row zero points' shape
        op("Add", ["zeros", "offset"], "x_zero_point_float"),
        op("Cast", ["x_zero_point_float"], "x_zero_point", to=TensorProto.UINT8),
        op("QuantizeLinear", ["x_rows", "x_scale", "x_zero_point"], "x_uint8", axis=0),
        op("MatMulInteger", ["x_uint8", "w_int8", "zero_point"], "y_int32"),
        op("Cast", ["y_int32"], "y_acc", to=TensorProto.FLOAT),
        op("Unsqueeze", ["x_scale", "axis_last"], "x_scale_col"),
        op("Mul", ["y_acc", "x_scale_col"], "y_rows_scaled"),
        op("Mul", ["y_rows_scaled", "w_scale"], "y_rows"),
        op("Shape", [x], "x_shape"),
        op("Slice", ["x_shape", "first", "axis_last"], "lead_dims"),
        op("Concat", ["lead_dims", "d_out"], "y_shape", axis=0),
        op("Reshape", ["y_rows", "y_shape"], y),
    ]
