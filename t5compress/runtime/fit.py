"""Whether the files of an ONNX export dir belong together, checked before any graph is loaded.

An export dir is three graphs (or the encoder and the merged decoder) and a config.json. A truncated graph, or graphs
copied in from another model, used to surface as an ONNX Runtime error about `past_key_values` dimensions in the
middle of a generation, or not at all (a Triton repository written from them). Every command that reads an export
opens it through `sessions.detect_format`, which calls `check_export`: the graphs' declared input and output shapes
(read from the file headers, no weights) are compared with each other and with config.json:

    last_hidden_state, encoder_hidden_states   (..., d_model)
    logits                                     (..., vocab_size)
    past_key_values.{i}.* / present.{i}.*      (batch, heads of layer i, length, d_kv); i < num_decoder_layers
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from t5compress.errors import ModelError
from t5compress.names import DECODER_MERGED, GRAPHS, LAYOUT_KEY, ONNX_SUFFIX
from t5compress.onnxgraph import declared_io

CACHE = re.compile(r"(?:past_key_values|present)\.(\d+)\.(decoder|encoder)\.(?:key|value)")


def check_export(path: str | Path) -> None:
    """A one-line ModelError when a graph file of the ONNX export dir `path` is cut short or not ONNX, or when the
    graphs' shapes disagree with each other or with config.json (naming the graph, the tensor and both sizes)."""
    p = Path(path)
    try:
        config = json.loads((p / "config.json").read_bytes())
    except (OSError, ValueError):
        config = None  # the loaders name a missing or damaged config.json themselves
    expected = _sizes(config) if isinstance(config, dict) else {}
    seen: dict[str, tuple[int, str]] = {}  # what -> (size, the graph and tensor it was first seen in)
    for graph in (*GRAPHS, DECODER_MERGED):
        f = p / f"{graph}{ONNX_SUFFIX}"
        if not f.is_file():
            continue
        try:
            shapes = declared_io(f)
        except (OSError, ValueError) as e:
            raise ModelError(f"{f.name} in '{p}' is damaged or not an ONNX file: {e}") from None
        layers = {int(m.group(1)) for name in shapes if (m := CACHE.fullmatch(name))}
        if layers and "num_decoder_layers" in expected and max(layers) + 1 != expected["num_decoder_layers"]:
            raise _apart(p, "decoder layers", max(layers) + 1, f"{f.name} (its caches)",
                         expected["num_decoder_layers"], "config.json (num_decoder_layers)")
        for name, shape in shapes.items():
            for what, size in _facts(name, shape):
                where = f"{f.name} ({name})"
                want, source = (expected[what], "config.json") if what in expected else seen.get(what, (None, ""))
                if want is not None and size != want:
                    raise _apart(p, _label(what), size, where, want, source)
                seen.setdefault(what, (size, where))


def _facts(name: str, shape: tuple) -> list[tuple[str, int]]:
    """(what, size) that the declared `shape` of tensor `name` fixes: only fixed (int) axes say anything."""
    out = []
    if name in ("last_hidden_state", "encoder_hidden_states") and shape:
        out.append(("d_model", shape[-1]))
    elif name == "logits" and shape:
        out.append(("vocab_size", shape[-1]))
    elif (m := CACHE.fullmatch(name)) and len(shape) == 4:
        layer, kind = m.group(1), "heads" if m.group(2) == "decoder" else "cross_heads"
        out += [(f"{kind}.{layer}", shape[1]), ("d_kv", shape[3])]
    return [(what, size) for what, size in out if isinstance(size, int) and size > 0]


def _sizes(config: dict) -> dict[str, int]:
    """What config.json says each fact should be: d_model, vocab_size, d_kv, num_decoder_layers and the self- and
    cross-attention heads of every decoder layer (per layer when the model records a layout)."""
    ints = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    out = {k: ints[k] for k in ("d_model", "vocab_size", "d_kv") if k in ints}
    layers = ints.get("num_decoder_layers", ints.get("num_layers"))
    if layers is None:
        return out
    out["num_decoder_layers"] = layers
    blocks = ((config.get(LAYOUT_KEY) or {}).get("decoder") or {}).get("blocks") or []
    for i in range(layers):
        block = blocks[i] if i < len(blocks) and isinstance(blocks[i], dict) else {}
        heads = len(block["heads"]) if isinstance(block.get("heads"), list) else ints.get("num_heads")
        cross = block.get("cross_heads", ints.get("num_heads"))
        out.update({f"heads.{i}": heads, f"cross_heads.{i}": cross})
    return {k: v for k, v in out.items() if isinstance(v, int)}


def _label(what: str) -> str:
    kind, _, layer = what.partition(".")
    return {"heads": "self-attention heads", "cross_heads": "cross-attention heads"}.get(kind, kind) + (
        f" of decoder layer {layer}" if layer else "")


def _apart(p: Path, what: str, got: int, where: str, want: int, source: str) -> ModelError:
    return ModelError(f"the files of '{p}' do not belong together: {what}: {got} in {where}, {want} in {source}; "
                      "export the model again into a new directory")
