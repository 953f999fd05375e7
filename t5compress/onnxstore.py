"""Each weight once: every graph of an export dir points into one shared external data file.

    store_once(dir) -> {"tensors": ..., "unique": ..., "bytes": ..., "saved_bytes": ...}

optimum's layout keeps the decoder twice (`decoder_model.onnx` for the first step, `decoder_with_past_model.onnx` for
the others), the tied embedding in the encoder and in both decoders, and a merged decoder or `generator.onnx` holds
them again: a t5-small fp32 export was 1.9x its safetensors checkpoint, its int8 export 1.9x CTranslate2's. ONNX's
external data is (location, offset, length) per initializer, so several graphs may name the same bytes: `store_once`
rewrites every `*.onnx` of a dir so that each initializer of `MIN_BYTES` or more lives in `WEIGHTS_FILE`, identical
tensors (same bytes, whatever their names, dtypes or graphs) at one offset. Small tensors (shapes, axes, scalars) stay
inline. Large tensors start on a 4 KiB boundary, so that ONNX Runtime maps them from the file instead of reading
them into memory (its CPU provider maps external data whose offset is page-aligned). The graph files keep their
names and inputs: ONNX Runtime, `onnx.load`, optimum and Triton read the dir as before; a tool that copies one graph
file must take `WEIGHTS_FILE` with it (`external_files` names what a graph needs).

A leaf, as `onnxgraph`: it imports no other part of the package but `names`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from t5compress.names import ONNX_SUFFIX, WEIGHTS_FILE

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

MIN_BYTES = 1024  # smaller initializers stay inline (onnx's own size_threshold default)
ALIGN = 4096  # the page size: ONNX Runtime maps an external tensor from the file only at an aligned offset
ALIGN_FROM = 64 << 10  # tensors of this size and more are aligned (smaller ones would waste up to 4 KiB each)


def store_once(path: str | os.PathLike, models: dict[str, onnx.ModelProto] | None = None,
               min_bytes: int = MIN_BYTES) -> dict:
    """Rewrite every ONNX graph in the dir `path` so that its large initializers are stored once, in `WEIGHTS_FILE`;
    external data files the graphs named before are deleted. `models`: graphs by file name held in memory (weights
    loaded), written here as they are, each file parsed by no one; the dir's other graph files are each parsed
    once. Returns what was stored (tensors, unique ones, bytes, bytes saved against one copy per initializer)."""
    import onnx

    p, models = Path(path), dict(models or {})
    names = sorted({f.name for f in p.glob(f"*{ONNX_SUFFIX}") if f.is_file()} | set(models))
    old: set[Path] = set()
    scratch = p / f".{WEIGHTS_FILE}.partial"
    offsets: dict[bytes, tuple[int, int]] = {}  # content hash -> (offset, length)
    count = total = 0
    try:
        with open(scratch, "wb") as data:
            for name in names:
                model = models.pop(name) if name in models else _load(p / name, old)
                for t in _initializers(model.graph):
                    raw = _raw(t)
                    if raw is None or len(raw) < min_bytes:
                        continue
                    count, total = count + 1, total + len(raw)
                    key = hashlib.sha256(raw).digest()
                    if key not in offsets:
                        offsets[key] = (_append(data, raw), len(raw))
                    _point(t, *offsets[key])
                tmp = p / f".{name}.partial"
                onnx.save_model(model, str(tmp))  # every large tensor is external already: a small file
                os.replace(tmp, p / name)
        os.replace(scratch, p / WEIGHTS_FILE)
    finally:
        scratch.unlink(missing_ok=True)
    for f in old - {p / WEIGHTS_FILE}:
        f.unlink(missing_ok=True)
    unique = sum(n for _, n in offsets.values())
    log.info("%s: %d weight tensors, %d unique, %.1f MB stored once (%.1f MB saved)", p, count, len(offsets),
             unique / 1e6, (total - unique) / 1e6)
    return {"tensors": count, "unique": len(offsets), "bytes": unique, "saved_bytes": total - unique}


def _load(graph: Path, old: set[Path]) -> onnx.ModelProto:
    """The graph file `graph`, parsed once, its weights loaded; the external data files it named join `old`."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    model = onnx.load(str(graph), load_external_data=False)
    old |= {graph.parent / loc for loc in _locations(model)}
    load_external_data_for_model(model, str(graph.parent))
    return model


def external_files(graph: str | os.PathLike) -> list[str]:
    """The external data files (locations relative to its dir) the ONNX file `graph` names, without loading them."""
    import onnx

    return _locations(onnx.load(str(graph), load_external_data=False))


def _locations(model: onnx.ModelProto) -> list[str]:
    seen: dict[str, None] = {}
    for t in _initializers(model.graph):
        if t.data_location == t.EXTERNAL:
            seen.update({e.value: None for e in t.external_data if e.key == "location"})
    return list(seen)


def stored_twice(path: str | os.PathLike, min_bytes: int = MIN_BYTES) -> list[str]:
    """Large weight tensors of the dir `path` whose bytes are stored more than once (inline in a graph, or at two
    places of external data), as 'graph: tensor' for each copy after the first; empty when each is stored once."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor

    p = Path(path)
    where: dict[bytes, tuple] = {}  # content hash -> where its first copy is stored
    twice = []
    for g in sorted(p.glob(f"*{ONNX_SUFFIX}")):
        model = onnx.load(str(g), load_external_data=False)
        for t in _initializers(model.graph):
            place = _place(t)
            if t.data_location == t.EXTERNAL:
                load_external_data_for_tensor(t, str(p))
            raw = _raw(t)
            if raw is None or len(raw) < min_bytes:
                continue
            key = hashlib.sha256(raw).digest()
            if key in where and (place is None or where[key] != place):
                twice.append(f"{g.name}: {t.name}")
            where.setdefault(key, place)
    return twice


def _place(t) -> tuple | None:
    """(location, offset) of an external tensor; None when its bytes are inline."""
    if t.data_location != t.EXTERNAL:
        return None
    entry = {e.key: e.value for e in t.external_data}
    return entry.get("location"), int(entry.get("offset") or 0)


def _initializers(graph: onnx.GraphProto):
    """The initializers of `graph` and of every subgraph it holds (If branches, generator.onnx's Beam search)."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == a.GRAPH:
                yield from _initializers(a.g)
            elif a.type == a.GRAPHS:
                for sub in a.graphs:
                    yield from _initializers(sub)


def _raw(t) -> bytes | None:
    """The tensor's bytes as `raw_data` (typed fields converted); None for string tensors, which stay inline."""
    from onnx import numpy_helper

    if t.data_type == t.STRING:
        return None
    if not t.HasField("raw_data"):
        array = numpy_helper.to_array(t)
        if array.nbytes < MIN_BYTES:
            return None
        t.CopyFrom(numpy_helper.from_array(array, t.name))
    return t.raw_data


def _append(data, raw: bytes) -> int:
    """Write `raw` at the end of `data` (aligned when large); returns its offset."""
    offset = data.tell()
    if len(raw) >= ALIGN_FROM and offset % ALIGN:
        data.write(b"\0" * (ALIGN - offset % ALIGN))
        offset = data.tell()
    data.write(raw)
    return offset


def _point(t, offset: int, length: int) -> None:
    """Make `t` name its bytes in `WEIGHTS_FILE` at `offset`."""
    t.ClearField("raw_data")
    del t.external_data[:]
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = t.EXTERNAL


def weight_bytes(graph: str | os.PathLike, min_bytes: int = MIN_BYTES) -> int:
    """Bytes of the large weights the ONNX file `graph` holds or names (each stored tensor counted once): what the
    graph costs on disk apart from its structure, wherever its weights are stored."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    places: dict = {}
    for t in _initializers(model.graph):
        place = _place(t)
        if place is None:
            size = len(t.raw_data)
            place = ("inline", len(places))
        else:
            size = int({e.key: e.value for e in t.external_data}.get("length") or 0)
        if size >= min_bytes:
            places[place] = size
    return sum(places.values())
