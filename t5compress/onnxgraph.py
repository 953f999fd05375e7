"""Small helpers over an `onnx.GraphProto`, shared by the passes that edit graphs: export's (`export.simplify`),
quantize's and the runtime's (`runtime.sharedkv`). A leaf: it imports no other part of the package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx


def graph_index(graph: onnx.GraphProto) -> tuple[dict, dict, dict[str, int]]:
    """(initializers by name, the node producing each tensor, how many node inputs read each tensor)."""
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    return inits, producers, readers


class Index:
    """Producers, readers and constants of a graph, and new constants added to it."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.inits, self.producers, self.readers = graph_index(graph)

    def value(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor (initializer or Constant node), else None."""
        from onnx import numpy_helper

        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def shape_dim(self, name: str) -> tuple[str, int] | None:
        """(x, i) when `name` is Unsqueeze(Gather(Shape(x), i)): one dim of x as a 1-element tensor."""
        node = self.producers.get(name)
        gather = self.producers.get(node.input[0]) if node is not None and node.op_type == "Unsqueeze" else None
        shape = self.producers.get(gather.input[0]) if gather is not None and gather.op_type == "Gather" else None
        if shape is None or shape.op_type != "Shape" or len(shape.attribute):
            return None
        i = self.value(gather.input[1])
        return (shape.input[0], int(i)) if i is not None and i.size == 1 else None

    def constant(self, values: list[int], hint: str) -> str:
        """The name of a new int64 initializer holding `values`."""
        from onnx import numpy_helper

        name, k = f"{hint}/static_shape", 0
        while name in self.inits:
            k += 1
            name = f"{hint}/static_shape_{k}"
        t = numpy_helper.from_array(np.asarray(values, np.int64), name)
        self.graph.initializer.append(t)
        self.inits[name] = t
        return name


def drop_unused(graph: onnx.GraphProto) -> int:
    """Remove nodes whose outputs nothing reads (over and over, as chains empty), then unread initializers;
    returns how many nodes went."""
    if any(a.type == a.GRAPH for node in graph.node for a in node.attribute):
        return 0  # subgraphs read outer names: not followed here (exported graphs have none)
    outputs = {o.name for o in graph.output}
    before = len(graph.node)
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        kept = [n for n in graph.node if any(o in read for o in n.output)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    read = {name for node in graph.node for name in node.input} | outputs
    unread = [t for t in graph.initializer if t.name not in read]
    for t in unread:
        graph.initializer.remove(t)
    return before - len(graph.node)
