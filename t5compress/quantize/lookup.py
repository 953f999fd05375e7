"""One int8 embedding for the whole dir: the encoder looks tokens up in the decoder's int8 table.

A tied T5 embeds with the LM head's matrix, which each graph quantizes on its own: the decoders read the LM head's
int8 table by column (`graphs.share_lm_head_table`, or block-wise's MatMulNBits blocks, 8- or 4-bit), the encoder a
table of its own (a second 16 MB on t5-small, a quarter of the int8 dir once the decoders share their weights).
`share_lookup` replaces the encoder's lookup by a copy of the decoder's: the same nodes reading initializers with the
same bytes, which `onnxstore.store_once` then stores once. The lookup's values are the decoder's (one scale per
vocabulary entry where the encoder had one for the whole table, in static and dynamic int8; 4-bit blocks at 4 bits,
where the export's by-column encoder lookup had been left int8); the encoder's own activation quantization after the
lookup stays, and the stage's agreement check runs on the result.
"""

from __future__ import annotations

import logging

import onnx

from t5compress.quantize.graphs import EMBEDDING, sort_nodes

log = logging.getLogger(__name__)

PREFIX = "shared_lookup/"  # the copied nodes' and initializers' names in the encoder
GATHERS = ("Gather", "GatherBlockQuantized")  # a lookup's row gather: int8 rows, or 4-bit blocks (`nbits`)


def share_lookup(enc: onnx.ModelProto, dec: onnx.ModelProto) -> int:
    """Make the lookup of the graph `enc` (changed in place) a copy of the graph `dec`'s; returns the bytes of the
    encoder's own tables that went (0 when either graph has no lookup of the exported tied form: untied models, whose
    tables are the same bytes already)."""
    theirs, mine = _lookup(dec.graph), _lookup(enc.graph)
    if theirs is None or mine is None:
        return 0
    inits = {t.name: t for t in dec.graph.initializer}
    (nodes, ids, out), (old, my_ids, my_out) = theirs, mine
    if not all(n.name for n in (*nodes, *old)):
        return 0  # nodes are told apart by name below
    before = {t.name: len(t.raw_data) for t in enc.graph.initializer}
    rename = {ids: my_ids, out: my_out}
    for n in nodes:
        for x in n.input:
            if x in inits and x not in rename:
                copy = onnx.TensorProto()
                copy.CopyFrom(inits[x])
                copy.name = rename[x] = PREFIX + x
                enc.graph.initializer.append(copy)
    dead = {n.name for n in old}
    for n in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = PREFIX + n.name
        copy.input[:] = [rename.get(x, PREFIX + x) if x else x for x in n.input]
        copy.output[:] = [rename.get(x, PREFIX + x) for x in n.output]
        enc.graph.node.append(copy)
    sort_nodes(enc, dead)
    read = {x for n in enc.graph.node for x in n.input}
    unread = [t for t in enc.graph.initializer if t.name not in read]
    for t in unread:
        enc.graph.initializer.remove(t)
    saved = sum(before.get(t.name, 0) for t in unread)
    log.info("encoder lookup reads the decoder's table (%d nodes; %.1f MB of the encoder's own went)", len(nodes),
             saved / 1e6)
    return saved


def _lookup(graph: onnx.GraphProto) -> tuple[list, str, str] | None:
    """(nodes, ids, output) of the token lookup in `graph`: the nodes between the token ids and the looked-up
    (d_model, batch, len) values that the export's `/to_rows` Transpose reads, past the activation quantization a
    static graph puts after them; None when the graph has no such lookup."""
    producers = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}
    rows = next((n for n in graph.node if n.op_type == "Transpose" and n.name.endswith(f"{EMBEDDING}/to_rows")),
                None)
    if rows is None:
        return None
    out = rows.input[0]
    dq = producers.get(out)
    q = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if q is not None and q.op_type == "QuantizeLinear":  # the activation's Q/DQ: the graph's own, kept
        out = q.input[0]
    nodes, ids, todo, seen = [], set(), [out], set()
    while todo:
        name = todo.pop()
        node = producers.get(name)
        if node is None or name in inits or node.name in seen:
            if node is None and name not in inits:
                return None  # reaches a graph input: not a lookup over constants
            continue
        seen.add(node.name)
        nodes.append(node)
        for i, x in enumerate(node.input):
            if not x or x in inits:
                continue
            if node.op_type in GATHERS and i == 1:  # the token ids (indices)
                ids.add(x)
            else:
                todo.append(x)
    if len(ids) != 1 or not any(n.op_type in GATHERS for n in nodes):
        return None
    order = {id(n): i for i, n in enumerate(graph.node)}
    return sorted(nodes, key=lambda n: order[id(n)]), ids.pop(), out
