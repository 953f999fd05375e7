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
    return bool(quantized_ops(onnx.load(str(path), load_external_data=False)))


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


def untie_embeddings(src: Path, dst: Path) -> bool:
    """Give each token-embedding Gather its own copy of a matrix it shares with the LM head; True if one was shared.

    The export stores a tied embedding once per graph (a Gather on the LM head's transposed matrix, axis 1). ONNX
    Runtime's quantizer then quantizes that one initializer for both consumers, per output channel for the MatMul,
    which the Gather cannot take. Two int8 copies (a quarter of the fp32 bytes each) still beat one fp32 copy.
    """
    model = onnx.load(str(src))
    users: dict[str, int] = {}
    for n in model.graph.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    inits = {t.name: t for t in model.graph.initializer}
    changed = False
    for node in model.graph.node:
        if node.op_type == "Gather" and EMBEDDING in node.name and users.get(node.input[0], 0) > 1 \
                and node.input[0] in inits:
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[node.input[0]])
            copy.name = node.input[0] + "_embedding"
            model.graph.initializer.append(copy)
            node.input[0] = copy.name
            changed = True
    if changed:
        onnx.save(model, str(dst))
    return changed
