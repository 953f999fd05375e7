"""The model repository: which models, their configs, and the files each version directory holds.

    <name>/                    python text model: text in, text out (model.py, tokenizer + config files, runtime copy,
                               and in the default in-process flavour the three graphs, which it runs itself)
    <name>_encoder/            with leaves: encoder_model.onnx
    <name>_decoder/            with leaves: decoder_model.onnx (first step: fills the self- and cross-attention cache)
    <name>_decoder_with_past/  with leaves: decoder_with_past_model.onnx (every later step)
    <name>_generator/          with leaves and --search-graph, in place of the three: generator.onnx (the whole
                               search, called once per batch; in-process, the text model holds it instead)

In-process, the text model opens the graphs with ONNX Runtime in its own process: the cache never leaves it. With
leaves, it calls them over BLS at every step; they are `onnxruntime_onnx` models, or with `portable` python models
that run the same file with ONNX Runtime (`triton_models/onnx_graph.py`). Each ONNX file keeps its export name (and
its external-data files beside it), so the ONNX Runtime backend is told the name through `default_model_filename`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t5compress.errors import ConfigError, ModelError
from t5compress.names import (
    DECODER,
    DECODER_MASK,
    DECODER_WITH_PAST,
    ENCODER,
    GENERATOR,
    MANIFEST_FILE,
    ONNX_SUFFIX,
    WEIGHTS_FILE,
)
from t5compress.runtime import contract
from t5compress.triton import config as pbtxt

VERSION = "1"
LEAF_SUFFIXES = {ENCODER: "encoder", DECODER: "decoder", DECODER_WITH_PAST: "decoder_with_past",
                 GENERATOR: "generator"}
BLS_SOURCE = "t5_bls.py"
LEAF_SOURCE = "onnx_graph.py"
# What the server-side python needs of the package: the runtime and the modules it imports (numpy, onnxruntime and
# tokenizers are all they import in turn, and protobuf where the onnx package is installed: `onnxproto`).
RUNTIME_FILES = ("__init__.py", "errors.py", "names.py", "onnxgraph.py", "onnxproto.py", "textio.py", "runtime")
# Export-dir files the BLS model reads (tokenizer, special ids and generation defaults, graph tensor names).
NOT_COPIED = {"report.json", "t5compress.json"}

# The text model's declared max_batch_size: past any request a client can send, so that Triton passes a request
# bigger than the real limit to the model (which refuses it with a message naming both sizes and logs one line)
# instead of refusing it itself before the model sees it (nothing logged). The real limit travels as the parameter
# BATCH_PARAM; the dynamic batcher is steered to batches of that size (preferred_batch_size), and a larger batch it
# forms from a long queue is generated that many texts at a time.
DECLARED_MAX_BATCH = 2**31 - 1
BATCH_PARAM = "max_batch_texts"


@dataclass(frozen=True)
class ModelPlan:
    """One model of the repository: its validated config and the files of its version directory (dest <- src)."""

    name: str
    config: Any  # model_config_pb2.ModelConfig
    files: dict[str, Path]


def server_sources() -> Path:
    """The `triton_models/` folder (server-side python models), wherever t5compress is installed from."""
    spec = importlib.util.find_spec("triton_models")
    if spec is None or spec.origin is None:
        raise ModelError("the triton_models package (server-side models) is not installed beside t5compress")
    return Path(spec.origin).parent


def runtime_files() -> dict[str, Path]:
    """t5compress.runtime and what it imports, as `t5compress/...` destinations."""
    root = Path(__file__).resolve().parents[1]
    out = {}
    for entry in RUNTIME_FILES:
        src = root / entry
        for f in sorted(src.rglob("*.py")) if src.is_dir() else [src]:
            out[f"t5compress/{f.relative_to(root)}"] = f
    return out


def leaf_model(export: Path, graph: str, name: str, kind: str, instances: int, threads: int, max_batch: int,
               queue_delay_us: int, portable: bool) -> ModelPlan:
    """One graph as a model of its own. `max_batch` 0: not batched by Triton (generator.onnx, whose settings inputs
    have no batch axis; the text model sends it whole batches)."""
    onnx_file = export / f"{graph}{ONNX_SUFFIX}"
    inputs, outputs = pbtxt.graph_tensors(onnx_file, batched=max_batch > 0)
    common = {
        "name": name, "max_batch_size": max_batch, "input": inputs, "output": outputs,
        "instance_group": pbtxt.instance_group(kind, instances),
    }
    if max_batch > 0:
        common["dynamic_batching"] = {"max_queue_delay_microseconds": queue_delay_us}
    files = graph_files(export, graph)
    threads_param = {"intra_op_thread_count": str(threads), "inter_op_thread_count": "1"}
    if portable:
        cfg = {**common, "backend": "python", "parameters": pbtxt.parameters({**threads_param,
                                                                              "graph_file": onnx_file.name})}
        files.update({"model.py": server_sources() / LEAF_SOURCE, **runtime_files()})
    else:
        cfg = {**common, "platform": "onnxruntime_onnx", "default_model_filename": onnx_file.name,
               "optimization": {"graph": {"level": 1}},  # ONNX Runtime: all graph optimisations
               "parameters": pbtxt.parameters({**threads_param, "execution_mode": "0"})}  # 0: sequential
    return ModelPlan(name, pbtxt.build(cfg), files)


def graph_files(export: Path, graph: str) -> dict[str, Path]:
    """One graph's ONNX file and the external-data files it names (the dir's shared weights file, or optimum's
    per-graph names), by file name."""
    from t5compress.onnxstore import external_files

    onnx_file = export / f"{graph}{ONNX_SUFFIX}"
    return {onnx_file.name: onnx_file, **{Path(loc).name: export / loc for loc in external_files(onnx_file)}}


def bls_model(export: Path, name: str, leaves: dict[str, str], instances: int, max_batch: int, queue_delay_us: int,
              max_beams: int, max_new_tokens: int, max_input_tokens: int = -1) -> ModelPlan:
    """The text model that calls the leaf models `leaves` (graph name -> model name) over BLS: every decoder step,
    or, when `leaves` is the generator alone, once per batch."""
    params = {"max_beams": str(max_beams), "max_new_tokens": str(max_new_tokens),
              "max_input_tokens": str(max_input_tokens)}
    if GENERATOR in leaves:
        params["generator_model"] = leaves[GENERATOR]
    else:
        params["leaf_models"] = leaves
    return _text(export, name, instances, max_batch, queue_delay_us, params, {})


def text_model(export: Path, name: str, instances: int, threads: int, max_batch: int, queue_delay_us: int,
               max_beams: int, max_new_tokens: int, max_input_tokens: int = -1, decoupled: bool = False,
               search_graph: bool = False) -> ModelPlan:
    """The text model that runs the graphs itself (ONNX Runtime, `threads` intra-op threads per graph).

    `decoupled`: its scheduler answers each request when done (in-flight batching on an --inflight export) and
    streams on request (`stream` input); it may hold `max_batch * max_beams` rows in its running batch.
    `search_graph`: it holds generator.onnx alone and runs each batch as one call of it.
    """
    names = (GENERATOR,) if search_graph else (ENCODER, DECODER, DECODER_WITH_PAST)
    graphs = {dest: src for g in names for dest, src in graph_files(export, g).items()}
    params = {"in_process": "1", "intra_op_thread_count": str(threads), "max_beams": str(max_beams),
              "max_new_tokens": str(max_new_tokens), "max_input_tokens": str(max_input_tokens)}
    if search_graph:
        params["search"] = "graph"
    if decoupled:
        params.update({"decoupled": "1", "max_inflight_rows": str(max_batch * max_beams)})
    return _text(export, name, instances, max_batch, queue_delay_us, params, graphs, decoupled)


def batch_limit(config) -> int:
    """The texts a request may hold: the text model's BATCH_PARAM (see DECLARED_MAX_BATCH), else max_batch_size."""
    param = config.parameters.get(BATCH_PARAM)
    return int(param.string_value) if param is not None else config.max_batch_size


def has_inflight_layout(export: Path) -> bool:
    """Whether the export's graphs.json lists the in-flight decoder_with_past_model input (export --inflight)."""
    try:
        graphs = json.loads((export / MANIFEST_FILE).read_text())
        return DECODER_MASK in graphs[DECODER_WITH_PAST]["inputs"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _text(export: Path, name: str, instances: int, max_batch: int, queue_delay_us: int, params: dict,
          extra: dict[str, Path], decoupled: bool = False) -> ModelPlan:
    cfg = {
        "name": name, "backend": "python", "max_batch_size": DECLARED_MAX_BATCH,
        "input": [_tensor(t) for t in contract.inputs(decoupled)], "output": [_tensor(t) for t in contract.OUTPUTS],
        "dynamic_batching": {"max_queue_delay_microseconds": queue_delay_us, "preferred_batch_size": [max_batch]},
        "instance_group": pbtxt.instance_group("cpu", instances),  # tokenizer and search: CPU work in any case
        "parameters": pbtxt.parameters({**params, BATCH_PARAM: str(max_batch)}),
        **({"model_transaction_policy": {"decoupled": True}} if decoupled else {}),
    }
    files = {f.name: f for f in sorted(export.iterdir())
             if f.is_file() and f.suffix in (".json", ".model", ".txt") and f.name not in NOT_COPIED}
    files.update({**extra, "model.py": server_sources() / BLS_SOURCE, **runtime_files()})
    return ModelPlan(name, pbtxt.build(cfg), files)


def _tensor(t: contract.Tensor) -> dict[str, Any]:
    return pbtxt.tensor(t.name, t.data_type, t.dims, optional=t.optional)


def write(plan: ModelPlan, repo: Path) -> None:
    """Write `plan` under `repo`: config.pbtxt (checked again after reading it back) and the version files."""
    model_dir = repo / plan.name
    version = model_dir / VERSION
    version.mkdir(parents=True)
    text = pbtxt.render(plan.config)
    (model_dir / "config.pbtxt").write_text(text)
    if pbtxt.parse_config(model_dir / "config.pbtxt") != plan.config:
        raise ConfigError(f"config of {plan.name!r} does not read back as written")
    for dest, src in plan.files.items():
        (version / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, version / dest)  # copyfile: the umask's permissions, not the source's
    if WEIGHTS_FILE in plan.files:  # each model loads from its own dir: keep only the weights its graphs name
        from t5compress.onnxstore import store_once

        store_once(version)

