"""Rewrites of an exported with-past step for the runtime (`runtime.sharedkv` runs them at load, in memory).

`rewrite`: each decoder layer's self-attention becomes ONNX Runtime's `DecoderMaskedMultiHeadAttention` over a
cache buffer shared by the step's input and output (`past_present_share_buffer`): the new key and value are written
at `past_sequence_length`, beams read their history through `cache_indirection`. The Concats that grew the cache,
the attention's own MatMuls, Add, Softmax and Reshapes go; the relative position bias goes in as the kernel's
attention bias, and every Shape the graph took of the cache now reads `past_sequence_length`.

`per_input_cross`: each layer's cross-attention reads one copy of its input's keys and values for all its beams
(the query rows of an input's beams become the rows of one (beams, d_kv) query per head), so the runtime feeds the
cross-attention cache and the encoder mask per input instead of repeating them for every beam.

Both return how many layers they changed and leave the model as it was (0) unless every layer has the pattern the
export writes (`export.graphs` traced, `export.simplify` passed over, optionally quantized).

`row_lookups`: an embedding lookup that gathers columns of a tied int8 table (stored once, in the LM head's
(d_model, vocab) layout) gathers rows of a (vocab, d_model) table the caller makes (the runtime's: filled as ids
are looked up, `runtime.lazyrows`).
"""

from __future__ import annotations

from t5compress.names import DECODER_MASK
from t5compress.onnxproto import make_attribute, make_node, make_value_info

PAST_LEN, BEAM_WIDTH, INDIRECTION = "past_sequence_length", "beam_width", "cache_indirection"
INT32, INT64 = 6, 7  # TensorProto.DataType


def rewrite(model) -> int:
    """Swap every decoder layer's self-attention in a with-past `model` (onnx.ModelProto, changed in place) for
    DecoderMaskedMultiHeadAttention over a shared cache; returns the layers rewritten, 0 (and `model` unchanged)
    where any layer does not have the exported pattern."""
    from t5compress.onnxgraph import drop_unused

    g = model.graph
    names = {i.name for i in g.input}
    past = sorted((n for n in names if n.startswith("past_key_values.") and ".decoder." in n), key=_layer)
    if DECODER_MASK in names or not past or any(_elem(g, n) != 1 for n in past):
        return 0
    graph = _Graph(g)
    layers = [graph.layer(past[i], past[i + 1]) for i in range(0, len(past), 2)]
    if any(x is None for x in layers):
        return 0
    shapes = graph.shape_readers(past)
    if shapes is None:
        return 0
    _add_inputs(g)
    dropped = {id(n) for layer in layers for n in layer["drop"]} | {id(n) for n, _, _ in shapes}
    new_first = _shape_nodes(g, graph.index, shapes)
    by_out = {id(layer["out"]): _attention(layer) for layer in layers}
    nodes = [by_out.get(id(n), n) for n in g.node if id(n) not in dropped or id(n) in by_out]
    del g.node[:]
    g.node.extend(new_first + nodes)
    for v in (*g.input, *g.output):
        if v.name in past or v.name.replace("present.", "past_key_values.", 1) in past:
            v.type.tensor_type.shape.dim[2].dim_param = "max_length"
    drop_unused(g)
    return len(layers)


def _layer(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[1]), parts[3]


def _elem(g, name: str) -> int:
    return next(i.type.tensor_type.elem_type for i in g.input if i.name == name)


class _Graph:
    """Producers, readers and constants of a graph, for matching one layer's self-attention."""

    def __init__(self, g):
        from t5compress.onnxgraph import Index

        self.index = Index(g)
        self.readers: dict[str, list] = {}
        for n in g.node:
            for x in n.input:
                self.readers.setdefault(x, []).append(n)

    def only(self, name: str, op: str, skip: str = "Shape"):
        """The one node of type `op` reading `name` (nodes of type `skip` aside), else None."""
        found = [n for n in self.readers.get(name, []) if n.op_type != skip]
        return found[0] if len(found) == 1 and found[0].op_type == op else None

    def heads(self, reshape) -> tuple[int, int] | None:
        """(heads, d_kv) of a Reshape of (rows, 1, inner) to (rows, heads, 1, d_kv), else None."""
        t = self.index.value(reshape.input[1]) if reshape is not None and reshape.op_type == "Reshape" else None
        return (int(t[1]), int(t[3])) if t is not None and t.size == 4 and t[0] == 0 and t[2] == 1 else None

    def layer(self, key: str, value: str) -> dict | None:
        """One layer's pattern, from its past key and value inputs; None where it differs from the export's."""
        ck, cv = self.only(key, "Concat"), self.only(value, "Concat")
        if ck is None or cv is None or list(ck.input)[:1] != [key] or list(cv.input)[:1] != [value]:
            return None
        present_k, present_v = ck.output[0], cv.output[0]
        kt = self.only(present_k, "Transpose")
        scores = self.only(kt.output[0], "MatMul") if kt is not None else None
        ctx = self.only(present_v, "MatMul")
        if scores is None or ctx is None or list(ctx.input) != [ctx.input[0], present_v]:
            return None
        q, k, v = (self.index.producers.get(x) for x in (scores.input[0], ck.input[1], cv.input[1]))
        hq = self.heads(q)
        if hq is None or hq != self.heads(k) or hq != self.heads(v):
            return None
        chain = self._softmax_chain(scores.output[0], ctx.input[0])
        out = self.only(ctx.output[0], "Reshape", skip="")
        if chain is None or out is None:
            return None
        return {"q": q.input[0], "k": k.input[0], "v": v.input[0], "bias": chain, "heads": hq[0],
                "key": key, "value": value, "present": (present_k, present_v), "out": out,
                "drop": [ck, cv], "name": scores.name.rsplit("/", 1)[0]}

    def _softmax_chain(self, scores: str, probs: str) -> str | None:
        """The bias added to the scores when they reach `probs` through Add, Casts and Softmax only; else None."""
        add = self.only(scores, "Add", skip="")
        if add is None:
            return None
        bias = add.input[1] if add.input[0] == scores else add.input[0]
        x = add.output[0]
        while x != probs:
            found = self.readers.get(x, [])
            if len(found) != 1 or found[0].op_type not in ("Cast", "Softmax"):
                return None
            x = found[0].output[0]
        return bias

    def cross(self, key: str, value: str) -> dict | None:
        """One layer's cross-attention, from its cached key and value inputs; None where it differs from the
        export's: Transpose(key) read by the scores MatMul, whose query is a Reshape to (rows, heads, 1, d_kv), and
        MatMul(probabilities, value) read by one Reshape back to (rows, 1, inner)."""
        kt = self.only(key, "Transpose")
        scores = self.only(kt.output[0], "MatMul", skip="") if kt is not None else None
        ctx = self.only(value, "MatMul")
        if scores is None or ctx is None or list(scores.input)[1:] != [kt.output[0]] or list(ctx.input)[1:] != [value]:
            return None
        q = self.index.producers.get(scores.input[0])
        heads = self.heads(q)
        out = self.only(ctx.output[0], "Reshape", skip="")
        if heads is None or out is None or len(self.readers.get(q.output[0], [])) != 1:
            return None
        return {"q": q, "heads": heads, "scores": scores, "ctx": ctx, "out": out}

    def shape_readers(self, past: list[str]) -> list | None:
        """(Shape node, 'past' or 'present', the past input's name) for each Shape of a self-attention cache
        tensor; None for a Shape with start/end (the export writes none)."""
        found = []
        for name in past:
            present = name.replace("past_key_values.", "present.", 1)
            for which, tensor in (("past", name), ("present", present)):
                for n in self.readers.get(tensor, []):
                    if n.op_type == "Shape":
                        if len(n.attribute):
                            return None
                        found.append((n, which, name))
        return found


def _add_inputs(g) -> None:
    g.input.extend([
        make_value_info(PAST_LEN, INT32, [1]),
        make_value_info(BEAM_WIDTH, INT32, [1]),
        make_value_info(INDIRECTION, INT32, ["batch", "beams", "max_length"]),
    ])


def _shape_nodes(g, index, shapes: list) -> list:
    """Nodes computing what each Shape of a cache tensor gave, from past_sequence_length: (rows, heads, P, d_kv)
    for the past, P + 1 for the grown cache. The Shape nodes' outputs keep their names."""
    prefix = "/shared_cache"
    nodes = [make_node("Shape", ["input_ids"], [f"{prefix}/rows"], start=0, end=1),
             make_node("Cast", [PAST_LEN], [f"{prefix}/past"], to=INT64),
             make_node("Add", [f"{prefix}/past", index.constant([1], prefix)], [f"{prefix}/total"])]
    for n, which, past_name in shapes:
        t = next(v for v in g.input if v.name == past_name)
        heads, d_kv = (t.type.tensor_type.shape.dim[i].dim_value for i in (1, 3))
        length = f"{prefix}/past" if which == "past" else f"{prefix}/total"
        name = n.output[0]
        parts = [f"{prefix}/rows", index.constant([heads], name), length, index.constant([d_kv], name)]
        nodes.append(make_node("Concat", parts, [name], axis=0))
    return nodes


def _attention(layer: dict):
    inputs = [layer["q"], layer["k"], layer["v"], "", layer["bias"], layer["key"], layer["value"],
              PAST_LEN, BEAM_WIDTH, INDIRECTION]
    return make_node(
        "DecoderMaskedMultiHeadAttention", inputs, [layer["out"].output[0], *layer["present"]],
        name=f"{layer['name']}/shared_cache", domain="com.microsoft",
        num_heads=layer["heads"], past_present_share_buffer=1, scale=1.0)


def per_input_cross(model) -> int:
    """Let each layer's cross-attention read its input's keys and values once for all that input's beams (`model`,
    an onnx.ModelProto, changed in place); returns the layers changed, 0 (and `model` unchanged) where any layer
    does not have the exported pattern.

    Per layer: the query (rows, 1, inner) is reshaped to (inputs, beams, heads, d_kv), inputs read off the cached
    keys, and transposed to (inputs, heads, beams, d_kv), so that its scores against the (inputs, heads, enc_len,
    d_kv) keys are one (beams, enc_len) product per head; the context goes back to (rows, 1, inner). Fed a cache of
    one row per beam (inputs = rows) the graph computes what it did before. The encoder mask then has a row per
    input, which the cross-attention bias alone reads."""
    g = model.graph
    graph = _Graph(g)
    keys = sorted((i.name for i in g.input if i.name.startswith("past_key_values.") and ".encoder.key" in i.name),
                  key=_layer)
    plans = [graph.cross(key, key[: -len("key")] + "value") for key in keys]
    if not plans or any(p is None for p in plans):
        return 0
    inputs = "/per_input_cross/inputs"
    after: dict[int, list] = {}
    first = [make_node("Shape", [keys[0]], [inputs], start=0, end=1)]
    for p in plans:
        heads, d_kv = p["heads"]
        q, ctx, out = p["q"], p["ctx"], p["out"]
        target = graph.index.constant([-1, heads, d_kv], f"{q.name}/per_input")
        first.append(make_node("Concat", [inputs, target], [f"{q.name}/per_input_shape"], axis=0))
        q.input[1] = f"{q.name}/per_input_shape"
        by_head = make_node("Transpose", [q.output[0]], [f"{q.output[0]}/by_head"], perm=[0, 2, 1, 3])
        p["scores"].input[0] = by_head.output[0]
        by_row = make_node("Transpose", [ctx.output[0]], [f"{ctx.output[0]}/by_row"], perm=[0, 2, 1, 3])
        out.input[0] = by_row.output[0]
        out.input[1] = graph.index.constant([-1, 1, heads * d_kv], f"{out.name}/per_input")
        after[id(q)], after[id(ctx)] = [by_head], [by_row]
    nodes = first + [x for n in g.node for x in (n, *after.get(id(n), ()))]
    del g.node[:]
    g.node.extend(nodes)
    return len(plans)


def row_lookups(model, value, rows_of=None) -> dict:
    """Make each embedding lookup that gathers columns of an int8 (d_model, vocab) table gather rows of a transposed
    copy instead (`model`, an onnx.ModelProto, changed in place); returns the new tables (numpy arrays) by name,
    which the caller adds to the model: they are large, and it decides where their bytes live. `value(tensor)`: an
    initializer's array; `rows_of(tensor)`: the (vocab, d_model) rows of a table's initializer (default: a copy of
    its transpose; the runtime's are filled as ids are looked up, `runtime.lazyrows`).

    A tied table quantized with the LM head is stored once, in the LM head's (d_model, vocab) layout
    (`quantize.graphs.share_lm_head_table`), so a lookup reads one byte of each of d_model rows a vocabulary apart:
    a cache line per byte (t5-small's 512 per id). At 32 rows that Gather took 8% of a pruned static-int8 with-past
    step; over rows, the lookup reads 512 contiguous bytes per id. The lookup's pattern (Gather on axis 1 -> Cast ->
    Mul by the ids' own scales -> per-tensor Q/DQ -> Transpose to (..., d_model)) becomes Gather on axis 0 -> the
    same nodes, the scales gathered as (..., 1) -> no Transpose; a lookup that differs is left as it is."""
    graph = _Graph(model.graph)
    rows_of = rows_of or (lambda t: value(t).T.copy())
    added: dict = {}
    for gather in [n for n in model.graph.node if n.op_type == "Gather"]:
        plan = _column_lookup(graph, gather)
        if plan is None:
            continue
        scales, transpose = plan
        rows = f"{gather.input[0]}/rows"
        if rows not in added:
            added[rows] = rows_of(graph.index.inits[gather.input[0]])
        gather.input[0] = rows
        del gather.attribute[:]
        gather.attribute.append(make_attribute("axis", 0))
        if scales is not None:
            column = f"{scales.input[0]}/column"
            if column not in added:
                added[column] = value(graph.index.inits[scales.input[0]]).reshape(-1, 1)
            scales.input[0] = column
        for reader in graph.readers.get(transpose.output[0], []):
            for i, x in enumerate(reader.input):
                if x == transpose.output[0]:
                    reader.input[i] = transpose.input[0]
        model.graph.node.remove(transpose)
    return added


def _column_lookup(graph: _Graph, gather) -> tuple | None:
    """(the Gather of the ids' scales or None, the Transpose ending the lookup) of a Gather on axis 1 of an int8
    (d_model, vocab) table that has `row_lookups`' pattern, else None."""
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    table = graph.index.inits.get(gather.input[0])
    if axis != 1 or table is None or table.data_type != table.INT8 or len(table.dims) != 2:
        return None
    scales, x = None, gather.output[0]
    while True:
        found = graph.readers.get(x, [])
        if len(found) != 1 or x in {o.name for o in graph.index.graph.output}:
            return None
        node = found[0]
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [])
            return (scales, node) if perm and perm == [*range(1, len(perm)), 0] else None
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            if not all(_scalar(graph, t) for t in node.input[1:]):
                return None
        elif node.op_type == "Mul":
            other = node.input[1] if node.input[0] == x else node.input[0]
            scales = _id_scales(graph, other, gather.input[1])
            if scales is None and not _scalar(graph, other):
                return None
        elif node.op_type != "Cast":
            return None
        x = node.output[0]


def _scalar(graph: _Graph, name: str) -> bool:
    t = graph.index.inits.get(name)
    return t is not None and all(d == 1 for d in t.dims)


def _id_scales(graph: _Graph, name: str, ids: str):
    """The Gather on axis 0 of a (vocab,) initializer by `ids` that produces `name`, read by nothing else; or None."""
    node = graph.index.producers.get(name)
    if node is None or node.op_type != "Gather" or node.input[1] != ids or len(graph.readers.get(name, [])) != 1:
        return None
    table = graph.index.inits.get(node.input[0])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return node if table is not None and len(table.dims) == 1 and axis == 0 else None
