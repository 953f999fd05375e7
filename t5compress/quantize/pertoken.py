"""Per-token int8 for the linear layers whose inputs a static scale cannot hold: by default every linear layer of a
T5 v1.1 / Flan (gated-gelu) model.

Static int8 gives each activation tensor one scale, fixed at calibration. In a gated model the inputs of `wo` and of
an untied LM head vary by orders of magnitude from token to token, so one scale sized for the largest rounds the
others coarsely (on the gated test fixture the LM head alone, static int8, lowered next-token agreement from 99.7% to
98.6%), and every other statically scaled layer costs held-out outputs too. Here each row (token) of the input gets
its own scale at run time, and the weight one per output channel:

    m = max|x_row|                            (..., rows, 1)   Abs, ReduceMax
    x_q = round(127 * x / m) + 128 in uint8                    Div, QuantizeLinear (scale 1/127, zero point 128)
    y = ((x_q - 128) @ W_q) * m * (w_scale / 127)              MatMulIntegerToFloat (ONNX Runtime's, fused scaling)

The row's scale, m / 127, is split so that no node computes it: its 1/127 is QuantizeLinear's constant scale and is
folded into the weight's scales. An all-zero row needs no guard either: 0 / 0 quantizes to some uint8, and whatever
integers come out, m = 0 scales their product to an exact 0 (tested). Each node saved counts: every node ONNX
Runtime runs costs time whatever it computes (about 0.85 us of a one-row step, docs/benchmarks.md). Layers reading
the same input (q, k, v; wi_0, wi_1) share its quantization (4 nodes); each layer is one node. The
weights are stored int8, as in static int8 (the same size). The activations are uint8 around 128 rather than int8:
ONNX Runtime's fast x86 kernels are u8 x s8 (int8 x int8 made flan-t5-small's steps 4x slower on an AVX2 machine).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from t5compress.onnxgraph import graph_index
from t5compress.quantize.graphs import sort_nodes
from t5compress.quantize.methods import nearest_blocks

MS_DOMAIN = "com.microsoft"  # MatMulIntegerToFloat: ONNX Runtime's contrib op
Rounded = dict[str, tuple[np.ndarray, np.ndarray]]  # node name -> (int8 weight (d_in, d_out), scale (d_out,))


def rewrite(model: onnx.ModelProto, names: list[str] | set[str], weight_max: int = 127,
            rounded: Rounded | None = None) -> list[str]:
    """Rewrite the fp32 MatMul nodes `names` of `model` (changed in place; its nodes left in topological order) as
    per-token int8; returns those rewritten (a node already quantized, or whose weight another node shares, is
    left). Layers reading one input (q, k and v; wi_0 and wi_1) share its quantization. `rounded`: int8 weights and
    their scales by node name (e.g. `gptq.gptq_int8`'s); the other weights are rounded to nearest."""
    inits, _, users = graph_index(model.graph)
    by_input: dict[str, list] = {}
    for node in list(model.graph.node):
        weight = node.input[1] if node.op_type == "MatMul" else None
        if node.name in names and weight in inits and users.get(weight, 0) == 1:
            by_input.setdefault(node.input[0], []).append(node)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    for x, nodes in by_input.items():
        p = nodes[0].name.rsplit("/", 1)[0] + "/per_token_"
        model.graph.node.extend(_quantize_rows(model, x, p, opset))
        for node in nodes:
            w = (rounded or {}).get(node.name) or _nearest(numpy_helper.to_array(inits[node.input[1]]), weight_max)
            model.graph.node.extend(_matmul(model, node, w, p))
            model.graph.initializer.remove(inits[node.input[1]])
    done = [n.name for nodes in by_input.values() for n in nodes]
    if done and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    if done:
        sort_nodes(model, set(done))
    return done


def _constants(model: onnx.ModelProto, prefix: str, values: dict[str, np.ndarray]) -> None:
    model.graph.initializer.extend(numpy_helper.from_array(v, prefix + k) for k, v in values.items())


def _op(prefix: str, kind: str, inputs: list[str], out: str, outside: tuple[str, ...] = (), **attrs):
    """A node whose inputs and output are named `prefix` + name, but for the graph's own tensors `outside`."""
    def name(t: str) -> str:
        return t if t in outside else prefix + t
    return helper.make_node(kind, [name(i) for i in inputs], [name(out)], name=prefix + out.rsplit("/", 1)[-1],
                            **attrs)


def _quantize_rows(model: onnx.ModelProto, x: str, p: str, opset: int) -> list:
    """The nodes (and, added to `model`, the constants) quantizing `x` per row, in x's own shape: `p`x_uint8 and
    `p`x_scale (x's shape with 1 as its last axis) for the layers reading it. QuantizeLinear's per-axis scales take
    one axis, and a row of a (batch, length, channels) tensor has two: x is divided by its rows' maxima first, and
    QuantizeLinear (scale 1/127) only stretches, rounds and shifts."""
    _constants(model, p, {"step": np.array(1.0 / 127.0, np.float32),
                          "zero_point": np.array(128, np.uint8),
                          **({"axis_last": np.array([-1], np.int64)} if opset >= 18 else {})})
    reduce_max = (_op(p, "ReduceMax", ["x_abs", "axis_last"], "x_scale", keepdims=1) if opset >= 18 else
                  _op(p, "ReduceMax", ["x_abs"], "x_scale", axes=[-1], keepdims=1))  # axes became an input in 18
    return [
        _op(p, "Abs", [x], "x_abs", (x,)),
        reduce_max,
        _op(p, "Div", [x, "x_scale"], "x_scaled", (x,)),  # within [-1, 1]: the row's max maps to 1
        _op(p, "QuantizeLinear", ["x_scaled", "step", "zero_point"], "x_uint8"),  # * 127, round half to even, + 128
    ]


def _nearest(w: np.ndarray, weight_max: int) -> tuple[np.ndarray, np.ndarray]:
    """w (d_in, d_out) rounded to nearest on an int8 grid with a scale per output channel: (int8 w, scale (d_out,))."""
    q, scales = nearest_blocks(w, w.shape[0], weight_max)  # one block: every input channel
    return q, scales[0]


def _matmul(model: onnx.ModelProto, node, w: tuple[np.ndarray, np.ndarray], shared: str) -> list:
    """The nodes computing `node`'s output from the shared per-row quantization `shared` of its input, with the int8
    weight and per-output-channel scales `w`."""
    p = node.name.rsplit("/", 1)[0] + "/per_token_"
    _constants(model, p, {"w_int8": w[0], "w_scale": (w[1] / np.float32(127.0)).astype(np.float32)})  # see above
    s = [shared + t for t in ("x_uint8", "x_scale", "zero_point")]
    y = node.output[0]
    # ONNX Runtime's MatMulIntegerToFloat broadcasts a_scale against the output: (..., rows, 1) scales each row
    return [_op(p, "MatMulIntegerToFloat", [s[0], "w_int8", s[1], "w_scale", s[2]], y, (*s, y), domain=MS_DOMAIN)]
