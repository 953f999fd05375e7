"""Graph passes on a freshly exported graph that take out nodes ONNX Runtime would run at every step for nothing.

The tracer writes T5's Python shape arithmetic as nodes: every `view(batch, -1, heads, d_kv)` becomes Shape, Gather,
Unsqueeze and Concat feeding a Reshape, and every `transpose(1, 2)` a Transpose, also where the axis it moves has
length 1 (the one new token of a with-past step). ONNX Runtime cannot fold either (the batch is dynamic), and every
node costs time whatever it computes (about 0.85 us of a one-row with-past step on the project's VMs: flan-t5-small's
int8 step ran 812 nodes, and 518 in 3.03 instead of 3.28 ms after these passes, the untraced causal mask and
per-token int8's shorter form). What is removed here, each change exact (outputs bit-identical, tested):

- a Reshape whose target is built from the input's own dims gets a constant target, 0 standing for "this dim as it
  is" (ONNX's Reshape rule), when shape inference shows the dim it copied is the one at the same place;
- a Transpose that only moves axes of length 1 is a Reshape (same memory order), and a Reshape of a Reshape reads
  the first one's input;
- single-input Concats (the tracer's `torch.cat` of a cache with nothing) read their input: each was a copy of the
  whole cross-attention cache at every step;
- nodes and constants nothing reads any more.

Shape inference is ONNX Runtime's symbolic one, run on a copy of the graph without its weights (a T5 of any size
stays far under protobuf's 2 GiB); where it fails the shape-dependent passes are skipped and the graph stays valid.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from t5compress.onnxgraph import Index, drop_unused

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

Dim = int | str | None  # a known length, a symbol shared by the tensors that have it, or unknown


def simplify(model: onnx.ModelProto) -> dict[str, int]:
    """Run every pass on `model` (changed in place); returns what each pass changed, by name."""
    done = {"concats": drop_copying_concats(model.graph)}
    shapes = infer_shapes(model)
    done["reshapes"] = static_reshapes(model.graph, shapes) if shapes else 0
    done["transposes"] = unit_transposes(model.graph, shapes) if shapes else 0
    done["merged"] = merge_reshapes(model.graph)
    done["dropped"] = drop_unused(model.graph)
    return done


def drop_copying_concats(graph: onnx.GraphProto) -> int:
    """Remove Concat nodes with a single input, reading their input instead; returns how many."""
    outputs = {o.name for o in graph.output}
    renamed: dict[str, str] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Concat" and len(node.input) == 1 and node.output[0] not in outputs:
            renamed[node.output[0]] = renamed.get(node.input[0], node.input[0])
        else:
            kept.append(node)
    for node in kept:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    del graph.node[:]
    graph.node.extend(kept)
    return len(renamed)


def infer_shapes(model: onnx.ModelProto) -> dict[str, list[Dim]]:
    """Every tensor's shape as ONNX Runtime's symbolic shape inference sees it ({} when it fails)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    light = _without_weights(model)
    try:
        inferred = SymbolicShapeInference.infer_shapes(light, auto_merge=True)
    except Exception as e:  # its own assertion and key errors on shapes it does not follow: no shape passes then
        log.info("symbolic shape inference failed (%s): reshape and transpose passes skipped", e)
        return {}
    shapes: dict[str, list[Dim]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    return shapes


def _without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose large initializers are graph inputs (dims and type, no data): what inference needs."""
    import onnx

    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.graph.node.extend(model.graph.node)
    light.graph.input.extend(model.graph.input)
    light.graph.output.extend(model.graph.output)
    for t in model.graph.initializer:
        if np.prod(t.dims) > 64:  # a weight (small ones may be shape constants inference must read)
            light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            light.graph.initializer.append(t)
    return light


def static_reshapes(graph: onnx.GraphProto, shapes: dict[str, list[Dim]]) -> int:
    """Reshape targets built by Concat from constants and the dims of some x become constants; returns how many.

    A part Shape(x)[i] at place i becomes 0 (copy the input's dim i) only where inference gives the Reshape's input
    and x the same known dim there, so the copy is the value the nodes computed."""
    index = Index(graph)
    done = 0
    for node in graph.node:
        if node.op_type != "Reshape" or any(a.name == "allowzero" and a.i for a in node.attribute):
            continue
        concat = index.producers.get(node.input[1])
        if concat is None or concat.op_type != "Concat":
            continue
        data = shapes.get(node.input[0])
        target: list[int] | None = []
        for place, part in enumerate(concat.input):
            value, dim = index.value(part), index.shape_dim(part)
            if value is not None and value.size == 1 and int(value.reshape(-1)[0]) != 0:
                target.append(int(value.reshape(-1)[0]))
            elif dim is not None and dim[1] == place and _same_dim(data, shapes.get(dim[0]), place):
                target.append(0)
            else:
                target = None
                break
        if target is None or target.count(-1) > 1:
            continue
        node.input[1] = index.constant(target, node.name)
        done += 1
    return done


def _same_dim(a: list[Dim] | None, b: list[Dim] | None, i: int) -> bool:
    return a is not None and b is not None and len(a) > i and len(b) > i and a[i] is not None and a[i] == b[i]


def unit_transposes(graph: onnx.GraphProto, shapes: dict[str, list[Dim]]) -> int:
    """Transposes that only move axes of length 1 become Reshapes (same order in memory); returns how many."""
    index = Index(graph)
    done = 0
    for node in graph.node:
        shape = shapes.get(node.input[0]) if node.op_type == "Transpose" else None
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if shape is None or perm is None or len(perm) != len(shape):
            continue
        moved = [p for p in perm if shape[p] != 1]
        if moved != sorted(moved):
            continue
        target = [shape[p] if isinstance(shape[p], int) else (0 if p == i else -1) for i, p in enumerate(perm)]
        if target.count(-1) > 1:
            continue
        node.op_type = "Reshape"
        del node.attribute[:]
        node.input.append(index.constant(target, node.name))
        done += 1
    return done


def merge_reshapes(graph: onnx.GraphProto) -> int:
    """A Reshape whose input is another Reshape's output, read by nothing else, reads that Reshape's input (the
    second target decides the shape; each 0 in it must copy a dim the first one copied too); returns how many."""
    index = Index(graph)
    outputs = {o.name for o in graph.output}
    done = 0
    for node in graph.node:
        first = index.producers.get(node.input[0]) if node.op_type == "Reshape" else None
        if (first is None or first.op_type != "Reshape" or index.readers[first.output[0]] != 1
                or first.output[0] in outputs):
            continue
        s1, s2 = index.value(first.input[1]), index.value(node.input[1])
        if s1 is None or s2 is None or any(v == 0 and (i >= len(s1) or s1[i] != 0) for i, v in enumerate(s2)):
            continue
        node.input[0] = first.input[0]
        done += 1
    return done
