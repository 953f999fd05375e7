"""One-graph generation: an export's three graphs under ONNX Runtime's `BeamSearch` operator (com.microsoft).

    write_generator(export_dir) -> files written    # generator.onnx (+ generator.onnx_data)

`generator.onnx` takes text ids and the search settings and returns finished sequences, so a server that runs ONNX
graphs (Triton's ONNX Runtime backend, any ONNX Runtime binding) generates with no search code of its own:

    inputs   input_ids (batch, len) int32, max_length (1,) int32, min_length (1,) int32, num_beams (1,) int32,
             num_return_sequences (1,) int32, length_penalty (1,) float, repetition_penalty (1,) float,
             attention_mask (batch, len) int32
    outputs  sequences (batch, num_return_sequences, max_length) int32: the decoder start token first

Lengths count the decoder start token (max_length = max_new_tokens + 1). `early_stopping` and
`no_repeat_ngram_size` are attributes, fixed when the graph is built (from generation_config.json) and recorded in
graphs.json. The operator's T5 contract has two subgraphs: `encoder` (ids, mask -> each layer's cross-attention
keys and values; built here from encoder_model and the part of decoder_model that projects them) and `decoder`
(decoder_with_past_model with its inputs renamed and reordered; ONNX Runtime runs the first step through it with an
empty self-attention cache). Weights the subgraphs share are stored once, in the outer graph. Only plain layouts
are built: fp32 or int8 graphs, separate decoders, no in-flight mask.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from t5compress.errors import ConfigError
from t5compress.export.onnx import hoist, needs_external_data, save_onnx
from t5compress.names import (
    DECODER,
    DECODER_MASK,
    DECODER_WITH_PAST,
    ENCODER,
    GENERATOR,
    GENERATOR_INPUTS,
    GENERATOR_OUTPUTS,
    MANIFEST_FILE,
    ONNX_SUFFIX,
    past_names,
)
from t5compress.runtime.sessions import load_onnx

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)


def generator_settings(config: dict, generation: dict) -> dict[str, Any]:
    """What the graph fixes when built: special tokens and the two search attributes, checked to be expressible."""
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos = eos if isinstance(eos, list) else [eos]
    if len(eos) != 1 or eos[0] is None:
        raise ConfigError(f"--search-graph: ONNX Runtime's BeamSearch takes one EOS id; this model has {eos}")
    early = generation.get("early_stopping", False)
    if early not in (True, False):
        raise ConfigError(f"--search-graph: early_stopping {early!r} in generation_config.json; the in-graph search "
                          "supports true or false")
    return {
        "eos_token_id": int(eos[0]),
        "pad_token_id": int(generation.get("pad_token_id", config.get("pad_token_id", 0))),
        "decoder_start_token_id": int(generation.get("decoder_start_token_id", config["decoder_start_token_id"])),
        "early_stopping": bool(early),
        "no_repeat_ngram_size": int(generation.get("no_repeat_ngram_size") or 0),
    }


def check_graphs(encoder, decoder, with_past) -> None:
    """Refuse layouts the operator cannot drive, in one line naming what is wrong."""
    from onnx import TensorProto

    names = [i.name for i in with_past.graph.input]
    if DECODER_MASK in names:
        raise ConfigError("--search-graph: this export has the in-flight layout (decoder_with_past_model takes "
                          f"{DECODER_MASK}); export it without --inflight")
    for graph in (encoder, decoder, with_past):
        floats = [v.type.tensor_type.elem_type for v in graph.graph.output]
        if any(t != TensorProto.FLOAT for t in floats):
            raise ConfigError("--search-graph: the graphs return non-fp32 tensors (an fp16 export); ONNX Runtime's "
                              "BeamSearch needs fp32 logits and cache here; build it from an fp32 or int8 export")


def build_generator(encoder, decoder, with_past, config: dict, settings: dict) -> onnx.ModelProto:
    """The BeamSearch model over the three loaded graphs."""
    from onnx import TensorProto, helper

    check_graphs(encoder, decoder, with_past)
    layers = config.get("num_decoder_layers") or config["num_layers"]
    shared: dict[bytes, Any] = {}
    taken: set[str] = set()
    enc = _encoder_subgraph(encoder.graph, decoder.graph, layers, config, settings, shared, taken)
    dec = _decoder_subgraph(with_past.graph, layers, config, shared, taken)
    for sub in (enc, dec):  # ONNX Runtime wants the types of outer-scope values a subgraph reads
        used = {x for n in sub.node for x in n.input}
        sub.value_info.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in shared.values() if t.name in used)
    node = helper.make_node("BeamSearch", [*GENERATOR_INPUTS[:7], "", "", "attention_mask"], ["sequences"],
                            name="search", domain="com.microsoft", model_type=1, encoder=enc, decoder=dec,
                            **{k: int(v) for k, v in settings.items()})
    scalar = {"length_penalty": TensorProto.FLOAT, "repetition_penalty": TensorProto.FLOAT}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch_size", "sequence_length"])
              if n in ("input_ids", "attention_mask") else
              helper.make_tensor_value_info(n, scalar.get(n, TensorProto.INT32), [1]) for n in GENERATOR_INPUTS]
    out = helper.make_tensor_value_info("sequences", TensorProto.INT32,
                                        ["batch_size", "num_return_sequences", "max_length"])
    graph = helper.make_graph([node], GENERATOR, inputs, [out], initializer=list(shared.values()))
    domains = {"com.microsoft": 1}  # the operator's; int8 graphs may use that domain and others too
    for g in (encoder, decoder, with_past):
        for o in g.opset_import:
            domains[o.domain or ""] = max(domains.get(o.domain or "", 0), o.version)
    domains.pop("ai.onnx", None)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in domains.items()],
                              producer_name="t5compress")
    model.ir_version = with_past.ir_version
    return model


def _encoder_subgraph(encoder, decoder, layers: int, config: dict, settings: dict, shared: dict, taken: set):
    """(encoder_input_ids, encoder_attention_mask) int32 -> present_{key,value}_cross_i: encoder_model, then the
    nodes of decoder_model that the cross-attention keys and values need (its logits and self cache are dropped)."""
    from onnx import TensorProto, helper

    nodes = [_cast("encoder_input_ids", "enc/input_ids"), _cast("encoder_attention_mask", "enc/attention_mask")]
    nodes += _renamed_nodes(encoder, "enc/", shared, taken)
    start = helper.make_tensor("start", TensorProto.INT64, [1], [settings["decoder_start_token_id"]])
    nodes += [  # decoder_model reads its batch size from input_ids: a (batch, 1) column of start tokens
        helper.make_node("Identity", ["enc/last_hidden_state"], ["first/encoder_hidden_states"]),
        helper.make_node("Identity", ["enc/attention_mask"], ["first/encoder_attention_mask"]),
        helper.make_node("Shape", ["encoder_input_ids"], ["first/batch"], start=0, end=1),
        helper.make_node("Constant", [], ["first/one"], value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
        helper.make_node("Concat", ["first/batch", "first/one"], ["first/ids_shape"], axis=0),
        helper.make_node("ConstantOfShape", ["first/ids_shape"], ["first/input_ids"], value=start),
    ]
    nodes += _renamed_nodes(decoder, "first/", shared, taken)
    outputs, out_info = [], []
    heads, d_kv = config["num_heads"], config["d_kv"]
    for i in range(layers):
        for kind in ("key", "value"):
            name = f"present_{kind}_cross_{i}"
            nodes.append(helper.make_node("Identity", [f"first/present.{i}.encoder.{kind}"], [name]))
            outputs.append(name)
            out_info.append(helper.make_tensor_value_info(
                name, TensorProto.FLOAT, ["batch_size", heads, "encode_sequence_length", d_kv]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch_size", "encode_sequence_length"])
              for n in ("encoder_input_ids", "encoder_attention_mask")]
    return helper.make_graph(_needed(nodes, outputs), "encoder", inputs, out_info)


def _decoder_subgraph(with_past, layers: int, config: dict, shared: dict, taken: set):
    """decoder_with_past_model with the operator's names and order: input_ids, encoder_attention_mask (int32),
    past_{key,value}_self_i for every layer, then past_{key,value}_cross_i -> logits, present_{key,value}_self_i."""
    from onnx import TensorProto, helper

    heads, d_kv = config["num_heads"], config["d_kv"]
    nodes = [_cast("input_ids", "step/input_ids"), _cast("encoder_attention_mask", "step/encoder_attention_mask")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["batch_size", 1]),
              helper.make_tensor_value_info("encoder_attention_mask", TensorProto.INT32,
                                            ["batch_size", "encode_sequence_length"])]
    ours = {(int(n.split(".")[1]), n.split(".")[2], n.split(".")[3]): n for n in past_names(layers)}
    for side, tag, length in (("self", "decoder", "past_decode_sequence_length"),
                              ("cross", "encoder", "encode_sequence_length")):
        for i in range(layers):
            for kind in ("key", "value"):
                name = f"past_{kind}_{side}_{i}"
                inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                            ["batch_size", heads, length, d_kv]))
                nodes.append(helper.make_node("Identity", [name], ["step/" + ours[(i, tag, kind)]]))
    nodes += _renamed_nodes(with_past, "step/", shared, taken)
    outputs = [("logits", "logits", ["batch_size", 1, config["vocab_size"]])]
    outputs += [(f"present.{i}.decoder.{kind}", f"present_{kind}_self_{i}",
                 ["batch_size", heads, "past_decode_sequence_length + 1", d_kv])
                for i in range(layers) for kind in ("key", "value")]
    nodes += [helper.make_node("Identity", ["step/" + ours_name], [name]) for ours_name, name, _ in outputs]
    out_info = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for _, name, shape in outputs]
    return helper.make_graph(nodes, "decoder", inputs, out_info)


def _cast(name: str, to: str):
    from onnx import TensorProto, helper

    return helper.make_node("Cast", [name], [to], to=TensorProto.INT64, name=f"{to}/cast")


def _renamed_nodes(graph, prefix: str, shared: dict, taken: set) -> list:
    """`graph`'s nodes with every value under `prefix`, initializers hoisted (deduplicated) to the outer graph."""
    import onnx

    rename = {t.name: hoist(t, shared, taken) for t in graph.initializer}
    rename[""] = ""
    nodes = []
    for n in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = prefix + n.name
        copy.input[:] = [rename.get(x, prefix + x) for x in n.input]
        copy.output[:] = [prefix + x for x in n.output]
        nodes.append(copy)
    return nodes


def _needed(nodes: list, outputs: list[str]) -> list:
    """The nodes `outputs` depend on, in their order (drops decoder_model's logits and self-attention cache)."""
    need, kept = set(outputs), []
    for n in reversed(nodes):
        if any(o in need for o in n.output):
            kept.append(n)
            need.update(x for x in n.input if x)
    return kept[::-1]


def write_generator(out: Path, external: bool | None = None) -> list[Path]:
    """Build `out/generator.onnx` from the three graphs in `out` and record it in graphs.json; returns files
    written. `external`: keep the weights in generator.onnx_data (None: when they pass 1 GiB)."""
    model = generator_model(out, *(load_onnx(out / f"{name}{ONNX_SUFFIX}") for name in (ENCODER, DECODER,
                                                                                          DECODER_WITH_PAST)))
    if external is None:
        external = needs_external_data(sum(len(t.raw_data) for t in model.graph.initializer))
    files = save_onnx(model, out / f"{GENERATOR}{ONNX_SUFFIX}", external)
    log.info("in-graph search written to %s (%d shared weights)", files[0], len(model.graph.initializer))
    return files


def generator_model(out: Path, encoder, decoder, with_past) -> onnx.ModelProto:
    """The BeamSearch model over the three graphs given (in memory), with the export dir `out`'s config and
    generation settings; recorded in `out`'s graphs.json (the caller writes it)."""
    config = json.loads((out / "config.json").read_text())
    gen_file = out / "generation_config.json"
    settings = generator_settings(config, json.loads(gen_file.read_text()) if gen_file.is_file() else {})
    model = build_generator(encoder, decoder, with_past, config, settings)
    manifest_path = out / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest[GENERATOR] = {"inputs": list(GENERATOR_INPUTS), "outputs": list(GENERATOR_OUTPUTS), **settings}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return model


def same_rows(a, b, tok, beams: int) -> int:
    """Rows of two `generate` results that hold the same tokens (a batch is cropped to its longest row, so the
    shorter result is padded with the search's fill value first)."""
    import numpy as np

    from t5compress.runtime.search import fill_value

    fill = fill_value(tok, beams)
    width = max(a.shape[1], b.shape[1])
    a, b = (np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill) for x in (a, b))
    return int((a == b).all(axis=1).sum())


def check_generator(out: Path, max_new_tokens: int, strict: bool, rows: int = 8, seed: int = 5) -> dict:
    """generator.onnx against the Python search over the same dir's graphs, greedy and beam 2, on random ids.

    `strict` (fp32 graphs): a greedy row that differs is an ExportError. Beam rows are counted, not required: the
    operator stops a beam search by transformers' earlier rule (the best of all candidates, finished ones included,
    against the worst finished hypothesis), which can keep a different hypothesis. Int8 graphs may differ even
    greedily: the operator's first step runs decoder_with_past_model (empty cache), the Python search runs
    decoder_model, and each int8 graph has its own calibrated scales."""
    import numpy as np

    from t5compress.errors import ExportError
    from t5compress.runtime.model import load_runtime

    python, graph = load_runtime(out), load_runtime(out, search="graph")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(rows, 12))
    mask = np.ones_like(ids)
    mask[rows // 2:, 8:] = 0  # padded rows too
    report: dict[str, Any] = {"rows": rows, "max_new_tokens": max_new_tokens}
    for beams, name in ((1, "greedy"), (2, "beam2")):
        want = python.generate(ids, mask, num_beams=beams, max_new_tokens=max_new_tokens)
        got = graph.generate(ids, mask, num_beams=beams, max_new_tokens=max_new_tokens)
        report[name] = {"identical_rows": same_rows(want, got, python.tokens, beams)}
    if strict and report["greedy"]["identical_rows"] < rows:
        raise ExportError(f"generator.onnx: greedy search differs from the Python search over the same graphs on "
                          f"{rows - report['greedy']['identical_rows']} of {rows} rows; nothing written")
    return report
