"""ONNX's protobuf messages and the few helpers the runtime's graph rewrites need, without importing the onnx package.

`import onnx` costs a process 12-15 MB resident (its C++ extension: checker, shape inference, the operator schemas),
and the runtime only parses, edits and serialises graphs (`runtime.sharedkv`, `runtime.firststep`,
`runtime.stepgraph`). The message classes are the onnx package's own generated module (`onnx/onnx_ml_pb2.py`, which
needs only protobuf), loaded by file where onnx is not imported yet; protobuf keeps one class per message type, so
they are the classes `onnx.ModelProto` and the rest are once onnx is imported (tested). A leaf: it imports no other
part of the package.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np

# TensorProto.DataType -> numpy dtype, for the types a rewrite reads or writes
DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
# where a tensor without raw_data keeps its values (TensorProto's typed fields)
_TYPED = {1: "float_data", 7: "int64_data", 11: "double_data", 12: "uint64_data", 13: "uint64_data"}


@functools.cache
def messages():
    """The module holding ModelProto, TensorProto, ...: onnx's own when onnx is imported, else its generated
    `onnx_ml_pb2.py` loaded by file (ImportError where the onnx package is not installed)."""
    if "onnx" in sys.modules:
        return sys.modules["onnx"].onnx_ml_pb2
    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the onnx package is not installed")
    file = Path(spec.submodule_search_locations[0]) / "onnx_ml_pb2.py"
    loaded = importlib.util.spec_from_file_location("t5compress_onnx_ml_pb2", file)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def parse(data) -> object:
    """A ModelProto parsed from serialised bytes."""
    return messages().ModelProto.FromString(bytes(data))


def to_array(tensor) -> np.ndarray:
    """The value of an inline TensorProto (raw_data or its typed field), as numpy_helper.to_array gives it; other
    tensors (external data, strings, bfloat16, float8) through numpy_helper itself."""
    if tensor.data_type not in DTYPES or tensor.data_location == tensor.EXTERNAL:
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor)
    dtype = np.dtype(DTYPES[tensor.data_type])
    shape = tuple(tensor.dims)
    if tensor.HasField("raw_data"):
        return np.frombuffer(tensor.raw_data, dtype.newbyteorder("<")).reshape(shape)
    field = _TYPED.get(tensor.data_type, "int32_data")  # the int32 field holds every narrower type, fp16's bits too
    values = np.asarray(getattr(tensor, field))
    if tensor.data_type == 10:
        return values.astype(np.uint16).view(np.float16).reshape(shape)
    return values.astype(dtype).reshape(shape)


def from_array(a: np.ndarray, name: str):
    """A TensorProto holding `a` in raw_data (little-endian), as numpy_helper.from_array makes it."""
    t = messages().TensorProto()
    t.dims.extend(a.shape)
    t.data_type = tensor_type(a.dtype)
    t.raw_data = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
    t.name = name
    return t


def tensor_type(dtype) -> int:
    """The TensorProto.DataType of a numpy dtype."""
    dtype = np.dtype(dtype)
    return next(k for k, v in DTYPES.items() if np.dtype(v) == dtype)


def make_attribute(name: str, value):
    """An AttributeProto of an int, a float, bytes or str, or a list of ints or floats."""
    m = messages()
    a = m.AttributeProto(name=name)
    kind = m.AttributeProto
    if isinstance(value, bool | int | np.integer):
        a.i, a.type = int(value), kind.INT
    elif isinstance(value, float):
        a.f, a.type = value, kind.FLOAT
    elif isinstance(value, str | bytes):
        a.s, a.type = value.encode() if isinstance(value, str) else value, kind.STRING
    elif all(isinstance(v, int | np.integer) for v in value):
        a.ints.extend(int(v) for v in value)
        a.type = kind.INTS
    else:
        a.floats.extend(float(v) for v in value)
        a.type = kind.FLOATS
    return a


def make_node(op_type: str, inputs, outputs, name: str | None = None, domain: str | None = None, **attributes):
    """A NodeProto, its attributes sorted by name (as onnx.helper.make_node writes them)."""
    node = messages().NodeProto(op_type=op_type, input=list(inputs), output=list(outputs))
    if name:
        node.name = name
    if domain is not None:
        node.domain = domain
    node.attribute.extend(make_attribute(k, v) for k, v in sorted(attributes.items()) if v is not None)
    return node


def make_value_info(name: str, elem_type: int, shape) -> object:
    """A tensor ValueInfoProto: a dim_value per int, a dim_param per str."""
    v = messages().ValueInfoProto(name=name)
    t = v.type.tensor_type
    t.elem_type = elem_type
    for d in shape:
        dim = t.shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        else:
            dim.dim_value = d
    return v


def extract(model, inputs: list[str], outputs: list[str]):
    """The part of `model` that computes `outputs` from `inputs` (and initializers), as a new ModelProto: what
    `onnx.utils.Extractor.extract_model` cuts, without its checks."""
    g = model.graph
    produced = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    stop, reached, stack = set(inputs), set(), list(outputs)
    while stack:
        name = stack.pop()
        i = produced.get(name)
        if name in stop or i is None or i in reached:
            continue
        reached.add(i)
        stack += [x for x in g.node[i].input if x]
    nodes = [g.node[i] for i in sorted(reached)]
    used = {x for n in nodes for x in (*n.input, *n.output)}
    infos = {v.name: v for v in (*g.value_info, *g.input, *g.output)}
    missing = [n for n in (*inputs, *outputs) if n not in infos]
    if missing:
        raise ValueError(f"not graph values: {', '.join(missing)}")
    sub = messages().ModelProto(ir_version=model.ir_version, producer_name="t5compress.onnxproto.extract")
    sub.opset_import.extend(model.opset_import)
    sub.graph.name = f"Extracted from {{{g.name}}}"
    sub.graph.node.extend(nodes)
    sub.graph.input.extend(infos[n] for n in inputs)
    sub.graph.output.extend(infos[n] for n in outputs)
    sub.graph.initializer.extend(t for t in g.initializer if t.name in used)
    sub.graph.value_info.extend(v for v in g.value_info if v.name in used)
    return sub
