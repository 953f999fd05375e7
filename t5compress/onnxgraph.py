"""Small helpers over an `onnx.GraphProto`, shared by the passes that edit graphs: export's (`export.simplify`),
quantize's and the runtime's (`runtime.sharedkv`), and `weightless`, which takes a serialised model's weights out
of the way of such a pass without parsing them. Imports no other part of the package but `onnxproto` (the messages and
helpers without the onnx package, which the runtime does not import)."""

from __future__ import annotations

import os
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
        from t5compress.onnxproto import to_array

        if name in self.inits:
            return to_array(self.inits[name])
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return to_array(node.attribute[0].t)
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
        from t5compress.onnxproto import from_array

        name, k = f"{hint}/static_shape", 0
        while name in self.inits:
            k += 1
            name = f"{hint}/static_shape_{k}"
        t = from_array(np.asarray(values, np.int64), name)
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


def weightless(data, location: str, min_bytes: int = 1024) -> bytes:
    """A serialised ModelProto `data` (bytes, or a memoryview of a mapped file) re-encoded with every top-level
    initializer of `min_bytes` or more of raw data turned into external data: the bytes stay where they are in
    `data`, named by `location` and their offset (ONNX's external-data fields). A rewrite then parses a few hundred KB
    instead of the whole graph, and ONNX Runtime reads the weights from `data` itself when it is handed over under
    `location` (`SessionOptions.add_external_initializers_from_files_in_memory`). Works on the protobuf wire format,
    so it needs neither onnx nor a parse of the weights; smaller initializers (shapes, axes) stay inline."""
    out = []
    for field, start, end, begin in _fields(data, 0, len(data)):
        if field != 7:  # ModelProto.graph
            out.append(bytes(data[begin:end]))
            continue
        graph, last = [], start
        for inner, s, e, b in _fields(data, start, end):
            raw = next((r for f, *r in _fields(data, s, e) if f == 9), None) if inner == 5 else None
            if raw is None or raw[1] - raw[0] < min_bytes:  # not GraphProto.initializer, or no large raw_data
                continue
            graph.append(bytes(data[last:b]))
            kept = [bytes(data[fb:fe]) for f, _, fe, fb in _fields(data, s, e) if f != 9]
            refs = (("location", location), ("offset", str(raw[0])), ("length", str(raw[1] - raw[0])))
            tensor = b"".join([*kept, *(_message(13, _message(1, k.encode()) + _message(2, v.encode()))
                                        for k, v in refs), _varint(14 << 3), _varint(1)])  # data_location EXTERNAL
            graph.append(_message(5, tensor))
            last = e
        graph.append(bytes(data[last:end]))
        out.append(_message(7, b"".join(graph)))
    return b"".join(out)


def declared_io(path) -> dict[str, tuple[int | str, ...]]:
    """The declared shape of each graph input and output of the ONNX file at `path` (an int per fixed axis, the name
    of a symbolic one), read from the wire format: the nodes and weights are skipped, not parsed. A ValueError says
    why when the file is cut short or is no ONNX model."""
    import mmap

    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            raise ValueError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _declared_io(data)
            except IndexError:  # a varint runs past the end of the file
                raise ValueError("it is cut short") from None


def _declared_io(data) -> dict[str, tuple[int | str, ...]]:
    shapes: dict[str, tuple[int | str, ...]] = {}
    for field, start, end, _ in _fields(data, 0, len(data)):
        if end > len(data):
            raise ValueError(f"it is cut short ({len(data):,} bytes, a field runs to byte {end:,})")
        if field == 7:  # ModelProto.graph: its input (11) and output (12) ValueInfoProtos
            for s, e in (*_payloads(data, start, end, 11), *_payloads(data, start, end, 12)):
                name = next((bytes(data[a:b]).decode(errors="replace") for a, b in _payloads(data, s, e, 1)), "")
                dims = [_dim(data, a, b) for t in _payloads(data, s, e, 2) for tensor in _payloads(data, *t, 1)
                        for shape in _payloads(data, *tensor, 2) for a, b in _payloads(data, *shape, 1)]
                shapes[name] = tuple(dims)
    if not shapes:
        raise ValueError("it holds no complete graph")
    return shapes


def _payloads(data, start: int, end: int, field: int) -> list[tuple[int, int]]:
    """(start, end) of the payload of each length-delimited `field` of the message in data[start:end]."""
    return [(s, e) for f, s, e, b in _fields(data, start, end) if f == field and s != b]


def _dim(data, start: int, end: int) -> int | str:
    """A TensorShapeProto.Dimension: its dim_value (1, a varint) or dim_param (2, a string)."""
    for f, s, e, begin in _fields(data, start, end):
        if f == 1:
            return _read_varint(data, _read_varint(data, begin)[1])[0]
        if f == 2:
            return bytes(data[s:e]).decode(errors="replace")
    return "?"


def _fields(data, start: int, end: int):
    """(field number, payload start, payload end, field start) of each field of the message in data[start:end]; the
    payload of a length-delimited field is its bytes, of any other the field's own bytes."""
    i = start
    while i < end:
        begin = i
        key, i = _read_varint(data, i)
        wire = key & 7
        if wire == 2:
            n, i = _read_varint(data, i)
            yield key >> 3, i, i + n, begin
            i += n
            continue
        if wire == 0:
            _, i = _read_varint(data, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {begin}: not a serialised ONNX model")
        yield key >> 3, begin, i, begin
    if i != end:
        raise ValueError(f"a protobuf field runs past its message at byte {end}: a truncated ONNX model")


def _read_varint(data, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _message(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload
