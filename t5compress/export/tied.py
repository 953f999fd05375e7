"""Tied embeddings stored once per graph: the decoder's token embedding and its LM head are one matrix in T5.

The TorchScript-based exporter folds `lm_head.weight.T` into a constant of its own, so a tied decoder graph holds
the (vocab, d_model) embedding for its Gather and a (d_model, vocab) copy for the LM head's MatMul: 66 MB twice for
t5-small. `share_tied_weights` keeps only the transposed copy, which the MatMul reads as before, and rewrites the
embedding lookup to read the same initializer: `Gather(W^T, ids, axis=1)` gives (d_model, batch, len), and a small
Transpose turns it into (batch, len, d_model).

Why this form (measured on t5-small's decoder_with_past, 1 thread; NOTES-export.md has the numbers): it saves the
66 MB on disk, the LM head's MatMul keeps a plain initializer (ONNX Runtime pre-packs it as before, and int8
quantizers still find it), and per-step time stays within noise. A MatMul on `Transpose(W)` saves the same on disk,
but an offline `--optimize` folds the Transpose back into a second copy, and quantizers skip a MatMul whose weight
is computed. In memory every form holds two copies, because ONNX Runtime pre-packs the LM head's weight into its own
buffer; disabling pre-packing gives 63 MB back per graph but makes each step 1.5-3x slower, so it is not done.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)


def _users(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if name in n.input]


def find_tied_pairs(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, str, str]]:
    """(Gather node, embedding initializer, transposed initializer) for each Gather whose table is the transpose
    of an initializer some MatMul multiplies by; nothing when the weights are untied (T5 v1.1, Flan-T5)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    matmul_b = {}  # shape (d, vocab) -> initializer names used as a MatMul's B
    for n in graph.node:
        if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits:
            dims = tuple(inits[n.input[1]].dims)
            if len(dims) == 2:
                matmul_b.setdefault(dims, []).append(n.input[1])
    pairs = []
    for n in graph.node:
        if n.op_type != "Gather" or n.input[0] not in inits:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        table = inits[n.input[0]]
        if axis != 0 or len(table.dims) != 2:
            continue
        candidates = matmul_b.get((table.dims[1], table.dims[0]), [])
        if not candidates:
            continue
        embedding = numpy_helper.to_array(table)  # (vocab, d_model)
        for b in candidates:
            if (numpy_helper.to_array(inits[b]) == embedding.T).all():
                pairs.append((n, n.input[0], b))
                break
    return pairs


def share_tied_weights(proto: onnx.ModelProto) -> int:
    """Make every embedding lookup of `proto` read the LM head's transposed matrix; returns the bytes saved.

    Works in place on the top-level graph. The embedding initializer is removed when nothing else reads it.
    """
    graph = proto.graph
    saved = 0
    for gather, table, transposed in find_tied_pairs(graph):
        saved += _by_column(graph, gather, table, transposed)
        log.info("tied embedding %s stored once (lookup reads %s)", table, transposed)
    return saved


def _by_column(graph: onnx.GraphProto, gather: onnx.NodeProto, table: str, transposed: str) -> int:
    """Make `gather` (axis 0 on `table`, (vocab, d_model)) read `transposed` (d_model, vocab) by column instead;
    returns the bytes saved when `table` is no longer read."""
    from onnx import helper

    looked_up = gather.output[0]
    tmp = f"{looked_up}/by_column"
    gather.input[0] = transposed
    del gather.attribute[:]
    gather.attribute.append(helper.make_attribute("axis", 1))  # (d_model, *ids.shape)
    gather.output[0] = tmp
    index = list(graph.node).index(gather)
    perm = helper.make_node("Transpose", [tmp], [looked_up], name=f"{gather.name}/to_rows", perm=[1, 2, 0])
    graph.node.insert(index + 1, perm)  # (batch, len, d_model), as before: ids are (batch, len) in T5's graphs
    if _users(graph, table):
        return 0
    init = next(t for t in graph.initializer if t.name == table)
    graph.initializer.remove(init)
    return len(init.raw_data) or 4 * _numel(init)


def share_with_decoder(encoder: onnx.ModelProto, decoder: onnx.ModelProto) -> int:
    """Make the encoder's embedding lookup read the decoder's tied (d_model, vocab) matrix, as the decoder's own
    lookup does after `share_tied_weights`; returns the bytes the encoder no longer holds apart.

    T5's encoder and decoder embed with the one `shared` matrix, but the decoder keeps it transposed (the LM head's
    orientation) and the encoder as rows: two layouts of the same weights, which no store by content can share. Here
    the encoder gets an initializer holding the decoder's bytes under its own name (the export dir then stores it
    once, `onnxstore`); the lookup runs once per call, so reading columns costs nothing measurable. Untied models
    (T5 v1.1, Flan) have the same (vocab, d_model) table in both graphs already: nothing to do.
    """
    from onnx import numpy_helper

    dec = {t.name: t for t in decoder.graph.initializer}
    columns = [n.input[0] for n in decoder.graph.node if n.op_type == "Gather" and n.input[0] in dec
               and next((a.i for a in n.attribute if a.name == "axis"), 0) == 1 and len(dec[n.input[0]].dims) == 2]
    if not columns:
        return 0
    transposed = numpy_helper.to_array(dec[columns[0]])  # (d_model, vocab)
    graph, saved = encoder.graph, 0
    inits = {t.name: t for t in graph.initializer}
    for n in list(graph.node):
        table = inits.get(n.input[0]) if n.op_type == "Gather" and n.input else None
        if table is None or next((a.i for a in n.attribute if a.name == "axis"), 0) != 0 or \
                tuple(table.dims) != transposed.shape[::-1]:
            continue
        if not (numpy_helper.to_array(table) == transposed.T).all():
            continue
        name = f"{table.name}/transposed"
        if name not in inits:
            inits[name] = numpy_helper.from_array(transposed, name)
            graph.initializer.append(inits[name])
        saved += _by_column(graph, n, table.name, name)
        log.info("encoder embedding %s reads the decoder's tied matrix", table.name)
    return saved


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n
