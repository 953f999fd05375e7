"""Triton `config.pbtxt` files, generated from code and checked against Triton's own schema before they are written.

A config is built as a plain dict in the JSON form of Triton's `ModelConfig` protobuf, parsed into
`tritonclient.grpc.model_config_pb2.ModelConfig` (unknown fields and enum values are errors there), checked for what
the schema cannot say (names, dims, batching), and only then printed as text format. `parse_config` reads a written
file back through the same schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from t5compress.errors import ConfigError, ModelError, first_line

# ONNX TensorProto element types -> Triton data types (what exported T5 graphs use, fp32/fp16/int8 exports alike).
ONNX_TO_TRITON = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 6: "TYPE_INT32", 7: "TYPE_INT64", 9: "TYPE_BOOL",
                  10: "TYPE_FP16", 11: "TYPE_FP64", 16: "TYPE_BF16"}
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
KINDS_BY_VALUE = {1: "gpu", 2: "cpu"}  # ModelInstanceGroup.Kind values


def _pb2():
    try:
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise ConfigError(
            f"Triton configs need tritonclient[grpc] ({e.name} is missing): pip install 't5compress[triton]'"
        ) from None
    return model_config_pb2, json_format, text_format


def tensor(name: str, data_type: str, dims: Sequence[int], optional: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "data_type": data_type, "dims": [str(d) for d in dims]}
    if optional:
        out["optional"] = True
    return out


def graph_tensors(onnx_path: Path, batched: bool) -> tuple[list[dict], list[dict]]:
    """The inputs and outputs of an ONNX graph as Triton tensors (dims without the batch axis when `batched`)."""

    from t5compress.runtime.sessions import load_onnx

    graph = load_onnx(onnx_path, load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}

    def convert(values) -> list[dict]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            if t.elem_type not in ONNX_TO_TRITON:
                raise ModelError(f"'{onnx_path.name}': tensor {v.name!r} has ONNX type {t.elem_type}, "
                                 "which has no Triton data type here")
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out.append(tensor(v.name, ONNX_TO_TRITON[t.elem_type], dims[1:] if batched else dims))
        return out

    return convert(graph.input), convert(graph.output)


def build(config: dict[str, Any]):
    """Parse a config dict through Triton's schema and check it; returns the `ModelConfig` message."""
    model_config_pb2, json_format, _ = _pb2()
    try:
        message = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    except json_format.ParseError as e:
        name = config.get("name")
        raise ConfigError(f"model config {name!r} does not fit Triton's schema: {first_line(e)}") from None
    check(message)
    return message


def check(message) -> None:
    """What the schema cannot say: named, typed tensors with sane dims; batching only with a batch axis."""
    name = message.name
    where = f"model config {name!r}"
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"{where}: a model name must be a plain directory name")
    if bool(message.backend) == bool(message.platform):
        raise ConfigError(f"{where}: set exactly one of backend and platform")
    seen: set[str] = set()
    for kind, tensors in (("input", message.input), ("output", message.output)):
        if not tensors:
            raise ConfigError(f"{where}: no {kind} tensors")
        for t in tensors:
            if not t.name or t.name in seen:
                raise ConfigError(f"{where}: {kind} name {t.name!r} is empty or repeated")
            seen.add(t.name)
            if t.data_type == 0:
                raise ConfigError(f"{where}: {kind} {t.name!r} has no data type")
            if not t.dims or any(d < -1 or d == 0 for d in t.dims):
                raise ConfigError(f"{where}: {kind} {t.name!r} dims {list(t.dims)} must be positive or -1")
    if message.HasField("dynamic_batching") and message.max_batch_size < 1:
        raise ConfigError(f"{where}: dynamic batching needs max_batch_size >= 1")
    if any(not 1 <= size <= message.max_batch_size for size in message.dynamic_batching.preferred_batch_size):
        raise ConfigError(f"{where}: preferred batch sizes must be within 1..max_batch_size")
    for group in message.instance_group:
        if group.count < 1:
            raise ConfigError(f"{where}: an instance group needs count >= 1")


def render(message) -> str:
    """Text format, as Triton reads it."""
    _, _, text_format = _pb2()
    return text_format.MessageToString(message)


def parse_config(path: str | Path):
    """Read a `config.pbtxt` through Triton's schema (text_format), returning the `ModelConfig` message."""
    model_config_pb2, _, text_format = _pb2()
    try:
        return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as e:
        raise ConfigError(f"'{path}' is not a valid Triton model config: {first_line(e)}") from None


def parameters(values: dict[str, Any]) -> dict[str, Any]:
    return {k: {"string_value": v if isinstance(v, str) else json.dumps(v)} for k, v in values.items()}


def instance_group(kind: str, count: int) -> list[dict[str, Any]]:
    return [{"kind": KINDS[kind], "count": count}]
