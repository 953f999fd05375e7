"""ONNX export of the declared graphs: the package's one `torch.onnx.export` call, external data, merging, optimising.

Export uses the TorchScript-based exporter (`dynamo=False`): it matched PyTorch exactly on T5 here and keeps every
declared dynamic axis. Each graph is exported to a scratch file, then re-saved by `save_onnx`, which alone decides
between one file and external data, so the two-gigabyte protobuf limit is handled in one place.
torch, onnx and onnxruntime are imported inside the functions: the CLI imports this module's constants (through the
export config) and `t5compress --help` must stay fast.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from t5compress.errors import ExportError, first_line
from t5compress.export.simplify import simplify
from t5compress.export.tied import share_tied_weights, share_with_decoder
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, ONNX_SUFFIX, USE_CACHE_BRANCH
from t5compress.runtime.sessions import load_onnx

if TYPE_CHECKING:
    import onnx
    import torch

    from t5compress.export.graphs import GraphSpec

log = logging.getLogger(__name__)

DEFAULT_OPSET = 17
# A protobuf cannot exceed 2 GiB; the exporter's scratch decoder graph holds a tied embedding twice (gather +
# transposed lm head) before `share_tied_weights` removes one, so the decision is made well below the limit.
EXTERNAL_DATA_THRESHOLD = 1 << 30
OPT_LEVELS = ("basic", "extended")


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's unique parameters (tied weights counted once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique)


def needs_external_data(nbytes: int, threshold: int = EXTERNAL_DATA_THRESHOLD) -> bool:
    return nbytes > threshold


def data_file(path: Path) -> str:
    """The external data file beside `path` (optimum's naming: `encoder_model.onnx_data`)."""
    return path.name + "_data"


def save_onnx(proto: onnx.ModelProto, path: Path, external: bool) -> list[Path]:
    """Save `proto` to `path`, with all tensors in one external data file when `external`; returns files written."""
    import onnx

    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_file(path), size_threshold=1024)
        return [path, path.with_name(data_file(path))]
    onnx.save_model(proto, str(path))
    return [path]


def export_graph(model: torch.nn.Module, spec: GraphSpec, path: Path, opset: int, external: bool,
                 share_tied: bool = True) -> list[Path]:
    """Trace `spec`'s wrapper of `model` and write it to `path` (the package's single `torch.onnx.export` call)."""
    import torch

    scratch = path.parent / f".{path.stem}.scratch"
    scratch.mkdir()
    try:
        wrapper = spec.wrap(model).eval()
        # TracerWarnings flag the Python branches of transformers' cache code; verification on other shapes is what
        # proves the graph general, so they are noise to users. The legacy exporter is a deliberate choice (see the
        # module docstring), so its deprecation notice is too. Silenced for this call only, not process-wide.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            for notice in ("You are using the legacy TorchScript-based ONNX export", "The feature will be removed"):
                warnings.filterwarnings("ignore", notice, DeprecationWarning)
            torch.onnx.export(
                wrapper,
                dummy_inputs(model, spec),
                str(scratch / path.name),
                input_names=list(spec.inputs),
                output_names=list(spec.outputs),
                dynamic_axes=spec.dynamic_axes,
                opset_version=opset,
                dynamo=False,
                do_constant_folding=True,
            )
        proto = load_onnx(str(scratch / path.name))  # pulls in external data if the exporter wrote any
    except Exception as e:  # the exporter raises many types; the user needs one line naming the graph
        raise ExportError(f"ONNX export of {spec.name} failed: {first_line(e)}") from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _check_io(proto, spec)
    # Tied embedding + LM head: one matrix on disk, not two (no-op when untied). A QAT export keeps both: it writes
    # each as its own int8 table (the lookup per row, the LM head per output channel).
    saved = share_tied_weights(proto) if share_tied else 0
    if saved:
        log.info("%s: tied embedding stored once (%.1f MB less)", spec.name, saved / 1e6)
    log.info("%s: graph simplified (%s)", spec.name, ", ".join(f"{k} {v}" for k, v in simplify(proto).items()))
    return save_onnx(proto, path, external)


def dummy_inputs(model: torch.nn.Module, spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """`spec`'s tracing inputs, float ones (hidden states, cache) in the model's dtype: an fp16 model is traced with
    fp16 inputs, so its graph takes fp16 encoder_hidden_states and cache (ids and masks stay int64)."""
    dtype = model.dtype
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in spec.dummy_inputs(model.config))


def _check_io(proto: onnx.ModelProto, spec: GraphSpec) -> None:
    """The exporter drops unused inputs silently; a graph with other names than declared is a broken export."""
    inputs = tuple(i.name for i in proto.graph.input)
    outputs = tuple(o.name for o in proto.graph.output)
    if inputs != spec.inputs or outputs != spec.outputs:
        raise ExportError(f"{spec.name}: exported inputs/outputs {inputs} -> {outputs} differ from the declaration")


def export_onnx(
    model: torch.nn.Module, specs: dict[str, GraphSpec], out: Path, opset: int = DEFAULT_OPSET,
    external: bool | None = None, share_tied: bool = True,
) -> dict[str, list[Path]]:
    """Export every graph in `specs` to `out/<name>.onnx`; `external=None` decides from the parameter bytes."""
    if external is None:
        external = needs_external_data(parameter_bytes(model))
    files = {}
    for name, spec in specs.items():
        log.info("exporting %s (opset %d%s)", name, opset, ", external data" if external else "")
        files[name] = export_graph(model, spec, out / f"{name}{ONNX_SUFFIX}", opset, external, share_tied)
    if share_tied and ENCODER in specs and DECODER in specs:
        _encoder_reads_tied(out / f"{ENCODER}{ONNX_SUFFIX}", out / f"{DECODER}{ONNX_SUFFIX}", external)
    return files


def _encoder_reads_tied(encoder: Path, decoder: Path, external: bool) -> None:
    """The encoder's embedding lookup on the decoder's tied matrix (`tied.share_with_decoder`), so that the dir
    holds the embedding once."""
    proto = load_onnx(str(encoder))
    if share_with_decoder(proto, load_onnx(str(decoder), load_external_data=True)):
        save_onnx(proto, encoder, external)


# ---------------------------------------------------------------------------------------------------------------
# Merged decoder: one graph whose If node runs the with-past branch when `use_cache_branch` is true.


def merge_decoders(no_past: onnx.ModelProto, with_past: onnx.ModelProto) -> onnx.ModelProto:
    """Join the two decoder graphs under an If node on `use_cache_branch`, sharing identical initializers.

    Inputs: the first-step inputs, then every past_key_values tensor, then `use_cache_branch` (bool, shape (1,)).
    Outputs: the first-step decoder's (logits and the full cache). The with-past branch returns the cross-attention
    outputs empty (zero-length on the sequence axis): the cache does not change after the first step and the caller
    keeps it, so copying it out every step would be waste (optimum's merged decoder returns empty constants there
    too). The first step is run with zero-length past tensors.
    """
    from onnx import TensorProto, helper

    shared: dict[bytes, onnx.TensorProto] = {}
    taken: set[str] = set()
    outputs = [o.name for o in no_past.graph.output]
    past_in = [i for i in with_past.graph.input if i.name.startswith("past_key_values.")]
    first = _branch(no_past.graph, "first/", outputs, shared, taken)
    later = _branch(with_past.graph, "past/", outputs, shared, taken)
    cond = helper.make_tensor_value_info(USE_CACHE_BRANCH, TensorProto.BOOL, [1])
    node = helper.make_node(
        "If", [USE_CACHE_BRANCH], outputs, name=f"{USE_CACHE_BRANCH}/if", then_branch=later, else_branch=first
    )
    graph = helper.make_graph(
        [node],
        DECODER_MERGED,
        [*no_past.graph.input, *past_in, cond],
        [_loosen(a, b) for a, b in zip(first.output, later.output, strict=True)],
        initializer=list(shared.values()),
    )
    for o, name in zip(graph.output, outputs, strict=True):
        o.name = name
    merged = helper.make_model(graph, opset_imports=no_past.opset_import, producer_name="t5compress")
    merged.ir_version = no_past.ir_version
    return merged


def _branch(graph: onnx.GraphProto, prefix: str, outputs: list[str], shared: dict, taken: set) -> onnx.GraphProto:
    """A copy of `graph` as an If branch: outer inputs referenced by name, initializers hoisted and deduplicated,
    every other value renamed under `prefix` (ONNX forbids a subgraph value shadowing an outer one)."""
    import onnx
    from onnx import helper

    outer = {i.name for i in graph.input}
    rename = {name: name for name in outer}
    rename[""] = ""  # omitted optional inputs
    for t in graph.initializer:
        rename[t.name] = hoist(t, shared, taken)
    nodes = []
    for n in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ExportError(f"cannot merge decoders: node {n.name} ({n.op_type}) holds a subgraph")
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = prefix + n.name
        copy.input[:] = [rename.get(x, prefix + x) for x in n.input]
        copy.output[:] = [rename.setdefault(x, prefix + x) for x in n.output]
        nodes.append(copy)
    produced = {o.name: o for o in graph.output}
    branch_out = []
    for name in outputs:
        if name in produced:
            vi = _renamed(produced[name], rename[name])
        else:  # with-past branch: the cross-attention cache does not change after the first step; none is returned
            source = name.replace("present.", "past_key_values.", 1)
            if not any(n.name == f"{prefix}empty/axes" for n in nodes):
                nodes += [helper.make_node("Constant", [], [f"{prefix}empty/{k}"], name=f"{prefix}empty/{k}",
                                           value=helper.make_tensor(k, onnx.TensorProto.INT64, [1], [v]))
                          for k, v in (("start", 0), ("axes", 2))]
            empty = [source, f"{prefix}empty/start", f"{prefix}empty/start", f"{prefix}empty/axes"]
            nodes.append(helper.make_node("Slice", empty, [prefix + name], name=f"{prefix}{name}/empty"))
            vi = _renamed(next(i for i in graph.input if i.name == source), prefix + name)
            vi.type.tensor_type.shape.dim[2].Clear()
            vi.type.tensor_type.shape.dim[2].dim_value = 0  # (batch, heads, 0, d_kv)
        branch_out.append(vi)
    local = {x for n in graph.node for x in n.output}
    infos = [_renamed(v, rename[v.name]) for v in graph.value_info if v.name in local]
    return helper.make_graph(nodes, prefix.strip("/"), [], branch_out, value_info=infos)


def hoist(t: onnx.TensorProto, shared: dict, taken: set) -> str:
    """The outer-scope name of initializer `t`, reusing an identical tensor already hoisted."""
    from onnx import numpy_helper

    array = numpy_helper.to_array(t)
    key = hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).digest()
    if key not in shared:
        name, k = t.name, 0
        while name in taken:  # same name, different content (e.g. onnx::MatMul_12 in both graphs)
            k += 1
            name = f"{t.name}_{k}"
        taken.add(name)
        shared[key] = numpy_helper.from_array(array, name)
    return shared[key].name


def _renamed(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    import onnx

    copy = onnx.ValueInfoProto()
    copy.CopyFrom(vi)
    copy.name = name
    return copy


def _loosen(a: onnx.ValueInfoProto, b: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """The If output type: dims the two branches name differently become unnamed (e.g. sequence lengths)."""
    out = _renamed(a, a.name)
    for da, db in zip(out.type.tensor_type.shape.dim, b.type.tensor_type.shape.dim, strict=True):
        if da.dim_param != db.dim_param or da.dim_value != db.dim_value:
            da.Clear()
    return out


def remove_graph(out: Path, name: str) -> None:
    """Delete `out/<name>.onnx` and its external data file, if any."""
    path = out / f"{name}{ONNX_SUFFIX}"
    for f in (path, path.with_name(data_file(path))):
        f.unlink(missing_ok=True)


def write_merged(out: Path, external: bool) -> list[Path]:
    """Build `decoder_model_merged.onnx` from the two decoder graphs already in `out`."""
    no_past = load_onnx(str(out / f"{DECODER}{ONNX_SUFFIX}"))
    with_past = load_onnx(str(out / f"{DECODER_WITH_PAST}{ONNX_SUFFIX}"))
    path = out / f"{DECODER_MERGED}{ONNX_SUFFIX}"
    files = save_onnx(merge_decoders(no_past, with_past), path, external)
    check_merged(path)
    return files


def check_merged(path: Path) -> None:
    """An ExportError unless the merged decoder written at `path` is a valid ONNX model."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        raise ExportError(f"merged decoder is not a valid ONNX model: {first_line(e)}") from e


# ---------------------------------------------------------------------------------------------------------------
# Offline ONNX Runtime graph optimisation.


def optimize_onnx(path: Path, level: str = "extended", external: bool = False) -> list[Path]:
    """Replace `path` by ONNX Runtime's offline-optimised version of it (CPU provider); returns files written.

    "extended" fuses into ONNX Runtime's own ops (e.g. SimplifiedLayerNormalization), so the result needs
    ONNX Runtime (any version at least this one) with the CPU provider; "basic" keeps standard ONNX ops.
    """
    import onnxruntime as ort

    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}
    scratch = path.parent / f".{path.stem}.optimized"
    scratch.mkdir()
    try:
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[level]
        so.optimized_model_filepath = str(scratch / path.name)
        so.log_severity_level = 3
        if external:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data_file(path))
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's own exception types
            raise ExportError(f"ONNX Runtime could not optimise {path.name}: {first_line(e)}") from e
        written = []
        for f in sorted(scratch.iterdir()):
            shutil.move(str(f), str(path.parent / f.name))  # same filesystem: a rename
            written.append(path.parent / f.name)
        return written
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

