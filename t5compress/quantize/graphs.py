"""Which nodes of an exported T5 graph are quantized, which stay fp32, and whether a graph is quantized already.

Only the linear layers are quantized by default: MatMul/Gemm nodes whose weight is an initializer (q, k, v, o, wi,
wo, lm_head). The activation-by-activation MatMuls of attention (scores, softmax x values) stay fp32, and so does the
relative-position bucket arithmetic: quantizing every op type breaks it (shared/DESIGN.md). T5's exported node names
carry the module path (`/decoder/block.0/layer.2/DenseReluDense/wo/MatMul`), which is how layers are picked by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx

from t5compress.onnxgraph import graph_index
from t5compress.runtime.sessions import load_onnx

# Op types that only appear in a graph once something quantized it (QDQ, QOperator or dynamic).
QUANTIZED_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention", "GatherBlockQuantized", "MatMulNBits",
})
FFN_OUTPUT = "DenseReluDense/wo/"  # T5's FFN output projection: activation outliers in T5 v1.1 / Flan
EMBEDDING = "embed_tokens/Gather"


def quantized_ops(model: onnx.ModelProto) -> set[str]:
    """The quantization op types present in `model` (empty for an fp32 graph)."""
    return {n.op_type for n in model.graph.node} & QUANTIZED_OPS


def is_quantized(path: Path) -> bool:
    return bool(quantized_ops(load_onnx(str(path), load_external_data=False)))


def initializer_names(model: onnx.ModelProto) -> set[str]:
    return {t.name for t in model.graph.initializer}


def linear_nodes(model: onnx.ModelProto, op_types: tuple[str, ...] = ("MatMul", "Gemm")) -> list[str]:
    """Names of the nodes of `op_types` whose second input is a weight (an initializer): the linear layers."""
    inits = initializer_names(model)
    return [n.name for n in model.graph.node if n.op_type in op_types and len(n.input) > 1 and n.input[1] in inits]


def embedding_nodes(model: onnx.ModelProto) -> list[str]:
    """The token-embedding Gather nodes (the shared vocabulary matrix, 32128 x d_model for T5)."""
    inits = initializer_names(model)
    return [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
            and EMBEDDING in n.name]


def matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The names containing one of `patterns` (plain substrings, or regular expressions between slashes: /.../)."""
    out = []
    for name in names:
        for p in patterns:
            hit = re.search(p[1:-1], name) if len(p) > 2 and p.startswith("/") and p.endswith("/") else p in name
            if hit:
                out.append(name)
                break
    return out


def ffn_output_nodes(names: list[str]) -> list[str]:
    return [n for n in names if FFN_OUTPUT in n]


def untie_embeddings(model: onnx.ModelProto) -> bool:
    """Give each token-embedding Gather of `model` (in place) its own copy of a matrix it shares with the LM head; True
    if one was shared.

    The export stores a tied embedding once per graph (a Gather on the LM head's transposed matrix, axis 1). ONNX
    Runtime's quantizer then quantizes that one initializer for both consumers, per output channel for the MatMul,
    which the Gather cannot take. Two int8 copies (a quarter of the fp32 bytes each) still beat one fp32 copy.
    """
    inits = {t.name: t for t in model.graph.initializer}
    shared = shared_embeddings(model)
    for node in shared:
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[node.input[0]])
        copy.name = node.input[0] + "_embedding"
        model.graph.initializer.append(copy)
        node.input[0] = copy.name
    return bool(shared)


def shared_embeddings(model: onnx.ModelProto) -> list:
    """The token-embedding Gather nodes whose matrix another node reads too (the structure is enough)."""
    users: dict[str, int] = {}
    for n in model.graph.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    inits = initializer_names(model)
    return [node for node in model.graph.node if node.op_type == "Gather" and EMBEDDING in node.name
            and users.get(node.input[0], 0) > 1 and node.input[0] in inits]


def share_lm_head_table(model: onnx.ModelProto) -> int:
    """In a quantized graph (changed in place), make each embedding lookup read the LM head's int8 matrix; returns
    bytes saved.

    `untie_embeddings` gave the lookup its own copy so that ONNX Runtime's quantizer could treat the two consumers
    differently; once quantized, the LM head's int8 matrix (one scale per vocabulary entry) is as good a table for the
    lookup as the copy, so the copy goes: the lookup gathers the int8 columns of the ids it needs and multiplies them
    by their own scales. On disk the tied matrix is then stored once, in int8, and no step dequantizes the whole
    table (a DequantizeLinear of the full matrix feeding the Gather made every t5-small decoder step ~6x slower).
    """
    inits, producers, users = graph_index(model.graph)
    saved, dead = 0, set()
    for node in list(model.graph.node):
        if node.op_type != "Gather" or EMBEDDING not in node.name:
            continue
        if node.input[0].endswith("_embedding_quantized"):  # dynamic: Gather(int8 copy) -> DequantizeLinear
            after = [n for n in model.graph.node if node.output[0] in n.input]
            if len(after) != 1 or after[0].op_type != "DequantizeLinear":
                continue
            copy, dq, out = node.input[0], after[0], after[0].output[0]
        else:  # static: DequantizeLinear(int8 copy) -> Gather
            dq = producers.get(node.input[0])
            copy = dq.input[0] if dq is not None and dq.op_type == "DequantizeLinear" else ""
            if not copy.endswith("_embedding_quantized") or users.get(dq.output[0], 0) != 1:
                continue
            out = node.output[0]
            node.output[0] = f"{out}_int8"
        if _gather_scaled(model, node, copy, out, inits):
            dead.add(dq.name)
            if users.get(copy, 0) == 1:
                saved += len(inits[copy].raw_data)
                model.graph.initializer.remove(inits[copy])
        elif node.output[0] != out:
            node.output[0] = out
    if not dead:
        return 0
    sort_nodes(model, dead)
    return saved


def _gather_scaled(model: onnx.ModelProto, node, copy: str, out: str, inits: dict) -> bool:
    """Point lookup `node` at the LM head's int8 (d_model, vocab) table and write `out` = its columns x their scales.

    Only for a symmetric table (zero points 0) whose scale is one per vocabulary entry or one for all; else False
    and the graph is left as it was."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    base = copy[: -len("_embedding_quantized")]
    table, scale, zero = f"{base}_quantized", f"{base}_scale", f"{base}_zero_point"
    if not all(n in inits for n in (table, scale, zero)) or inits[table].dims != inits[copy].dims:
        return False
    dims = list(inits[scale].dims)
    if np.any(numpy_helper.to_array(inits[zero]) != 0) or len(dims) > 1 or (
            dims and dims[0] not in (1, inits[table].dims[1])):
        return False
    node.input[0] = table
    cast, picked = f"{base}_lookup_float", f"{base}_lookup_scale"
    per_entry = bool(dims) and dims[0] > 1
    model.graph.node.append(helper.make_node("Cast", [node.output[0]], [cast], name=f"{base}_lookup_Cast",
                                             to=TensorProto.FLOAT))
    if per_entry:
        model.graph.node.append(helper.make_node("Gather", [scale, node.input[1]], [picked],
                                                 name=f"{base}_lookup_scale_Gather", axis=0))
    model.graph.node.append(helper.make_node("Mul", [cast, picked if per_entry else scale], [out],
                                             name=f"{base}_lookup_Mul"))  # (d, b, l) x (b, l)
    return True


PROTO_LIMIT = 1_800_000_000  # protobuf cannot serialise a message of 2 GiB: larger graphs keep their weights beside


def save_graph(model: onnx.ModelProto, path: Path, external: bool = False) -> None:
    """Write `model` to `path`, its weights in `<name>_data` beside it when asked or when the graph would not fit in
    one file (saving them apart never serialises the whole graph at once: a t5-base decoder peaked at 1.9 GB saved
    whole, 1.0 GB apart)."""
    if external or sum(len(t.raw_data) for t in model.graph.initializer) > PROTO_LIMIT:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + "_data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def sort_nodes(model: onnx.ModelProto, drop: set[str] = frozenset()) -> None:
    """Put `model`'s nodes in topological order (a rewrite appends its new nodes at the end), without those named in
    `drop`."""
    kept = [n for n in model.graph.node if n.name not in drop]
    del model.graph.node[:]
    model.graph.node.extend(topological(kept))


def topological(nodes: list) -> list:
    """`nodes` in an order where every node comes after the producers of its inputs (ONNX requires it)."""
    produced_by = {o: i for i, n in enumerate(nodes) for o in n.output}
    order, state = [], {}

    def visit(i: int) -> None:
        stack = [(i, False)]
        while stack:
            j, done = stack.pop()
            if done:
                if state.get(j) != 2:
                    state[j] = 2
                    order.append(nodes[j])
                continue
            if state.get(j):
                continue
            state[j] = 1
            stack.append((j, True))
            for x in nodes[j].input:
                k = produced_by.get(x)
                if k is not None and not state.get(k):
                    stack.append((k, False))

    for i in range(len(nodes)):
        visit(i)
    return order


def int8_row_lookups(model: onnx.ModelProto, names: set[str]) -> int:
    """Make each embedding lookup among the Gather nodes `names` of `model` (in place) gather rows of an int8 copy of
    its table, each row scaled by its own scale; returns the lookups rewritten.

    A scale for the whole table (ONNX Runtime's QDQ and dynamic quantizers) rounds the rows of small norm coarsely:
    on the docstring fixture block-wise int8 kept 69.0% of held-out outputs with it, 72.2% with a scale per row
    (4 bytes a row), 75.9% with the table fp32 (0.37x the size instead of 0.28x). No step dequantizes the whole
    table: the rows are gathered first (a DequantizeLinear of a full table made every t5-small step ~6x slower)."""
    lookups = [n for n in model.graph.node if n.op_type == "Gather" and n.name in names]
    for node in lookups:
        _row_lookup(model, node)
    if lookups:
        sort_nodes(model)
    return len(lookups)


def _row_lookup(model: onnx.ModelProto, node) -> None:
    """`node` gathers rows of an int8 copy of its table, scaled by their own scales. A lookup along axis 1 (a tied
    table shared in its (d_model, vocab) layout) scales columns."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    table = inits[node.input[0]]
    w = numpy_helper.to_array(table).astype(np.float32)  # (vocab, d_model); gathered along axis 1: (d_model, vocab)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    scale = np.abs(w).max(axis=1 - axis, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    base, out = node.input[0], node.output[0]
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    # gathered scales: (batch, len, 1) beside rows (batch, len, d); (batch, len) beside columns (d, batch, len)
    scales = scale if axis == 0 else scale.reshape(-1)
    model.graph.initializer.extend([numpy_helper.from_array(q, f"{base}_int8_rows"),
                                    numpy_helper.from_array(scales.astype(np.float32), f"{base}_row_scale")])
    if sum(base in n.input for n in model.graph.node) == 1:
        model.graph.initializer.remove(table)
    node.input[0], node.output[0] = f"{base}_int8_rows", f"{out}_int8"
    model.graph.node.extend([
        helper.make_node("Cast", [f"{out}_int8"], [f"{out}_float"], name=f"{node.name}_Cast", to=TensorProto.FLOAT),
        helper.make_node("Gather", [f"{base}_row_scale", node.input[1]], [f"{out}_scale"], name=f"{node.name}_scale",
                         axis=0),
        helper.make_node("Mul", [f"{out}_float", f"{out}_scale"], [out], name=f"{node.name}_Mul")])
