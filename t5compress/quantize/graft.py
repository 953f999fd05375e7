"""Graph editing for the sensitivity search: which group an exported node belongs to, and an fp32 graph with chosen
nodes reading their inputs as a QDQ int8 graph of it does (`mixed`: graph surgery, no new quantization).

A *group* is one projection of one layer (`encoder.1 self q`, `decoder.0 cross o`, `decoder.3 wi_1`, `lm_head`,
`embeddings`), the same nodes in every graph that holds them (the decoder and decoder-with-past share their names).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
_LAYER = re.compile(
    r"/(encoder|decoder)/block\.(\d+)/layer\.\d+/(SelfAttention|EncDecAttention|DenseReluDense)/(\w+)/")
_KIND = {"SelfAttention": "self ", "EncDecAttention": "cross ", "DenseReluDense": ""}


def group_of(node: str) -> str:
    """The group label of an exported node: 'encoder.1 self q', 'decoder.0 cross o', 'decoder.3 wi_1', 'lm_head'."""
    m = _LAYER.search(node)
    if m:
        stack, block, kind, proj = m.groups()
        return f"{stack}.{block} {_KIND[kind]}{proj}"
    if "lm_head" in node:
        return "lm_head"
    if "embed_tokens" in node:
        return "embeddings"
    return node


def groups(nodes: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """{group: {graph: [node names]}} from the quantizable nodes of each graph, in first-seen order."""
    out: dict[str, dict[str, list[str]]] = {}
    for graph, names in nodes.items():
        for n in names:
            out.setdefault(group_of(n), {}).setdefault(graph, []).append(n)
    return out


def mixed(fp32: onnx.ModelProto, int8: onnx.ModelProto, names: set[str], quantizable: set[str] = frozenset(),
          ) -> onnx.ModelProto:
    """`fp32` in which the nodes `names` read their inputs as `int8` (a QDQ graph of it) does: through its
    QuantizeLinear/DequantizeLinear chains, with their int8 weights and scales, and hand on their outputs through its
    output pairs. Nodes outside `quantizable` that read those dequantized tensors in `int8` (ONNX Runtime's quantizer
    hands them to every consumer: residual adds, reshapes, the gate product) read them here too; the rest is fp32."""
    import onnx

    from t5compress.quantize.graphs import topological

    out = onnx.ModelProto()
    out.CopyFrom(fp32)
    graft = _Graft(out, int8)
    for node in out.graph.node:
        q = graft.quantized.get(node.name)
        if node.name in names and q is not None:
            graft.node(node, q)
    for node in out.graph.node:  # the other readers of what was quantized
        q = graft.quantized.get(node.name)
        if node.name not in names and node.name not in quantizable and q is not None \
                and len(q.input) == len(node.input) and any(t in graft.made for t in q.input):
            for i, t in enumerate(q.input):
                if t in graft.made:
                    node.input[i] = t
    nodes = topological(list(out.graph.node) + graft.added)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


class _Graft:
    """Copies QuantizeLinear/DequantizeLinear nodes (and the constants they read) of `int8` into `out`."""

    def __init__(self, out: onnx.ModelProto, int8: onnx.ModelProto):
        self.out, self.added, self.made = out, [], set()
        self.producers = {o: n for n in int8.graph.node for o in n.output}
        self.readers: dict[str, list] = {}
        for n in int8.graph.node:
            for x in n.input:
                self.readers.setdefault(x, []).append(n)
        self.quantized = {n.name: n for n in int8.graph.node}
        self.inits = {t.name: t for t in int8.graph.initializer}
        self.have = {o for n in out.graph.node for o in n.output} | {i.name for i in out.graph.input}
        self.have |= {t.name for t in out.graph.initializer}

    def constant(self, name: str) -> None:
        if name in self.inits and name not in self.have:
            self.out.graph.initializer.append(self.inits[name])
            self.have.add(name)

    def take(self, p) -> None:
        self.added.append(p)
        self.have.update(p.output)
        self.made.update(p.output)
        for x in p.input:
            self.constant(x)

    def node(self, node, q) -> None:
        """`node` of `out` reads and writes as its twin `q` of `int8` does."""
        stack = list(q.input)  # upstream: what the node reads (quantized activation, int8 weight)
        while stack:
            t = stack.pop()
            p = self.producers.get(t)
            if p is not None and p.op_type in QDQ_OPS and t not in self.have:
                self.take(p)
                stack.extend(p.input)
            elif p is None:
                self.constant(t)
        renamed = [o for o, qo in zip(node.output, q.output, strict=True) if o != qo]
        if renamed:  # a graph output (logits): the quantizer renamed the node's output, its DequantizeLinear makes it
            del node.output[:]
            node.output.extend(q.output)
            self.have.difference_update(renamed)
        stack = list(q.output)  # downstream: its output's QuantizeLinear/DequantizeLinear pair, if quantized
        while stack:
            for r in self.readers.get(stack.pop(), []):
                if r.op_type in QDQ_OPS and r.output[0] not in self.have:
                    self.take(r)
                    stack.extend(r.output)
        del node.input[:]
        node.input.extend(q.input)
