"""A self-attention cache written in place: with-past steps that neither copy the cache nor reorder it for beams.

An exported with-past step (optimum's layout, what the export dir holds) takes the cache and returns it one token
longer: a Concat per key and value tensor of each layer, so every step copied the whole cache, and beam search then
gathered the rows of every moved beam (flan-t5-small int8 at 32 rows: 1.3-1.5 ms of a 13.7 ms step, plus 0.5 ms a
step on the host). `open_shared` rewrites the dir's graph in memory at load (`runtime.stepgraph`: each layer's
self-attention becomes `DecoderMaskedMultiHeadAttention` with `past_present_share_buffer`, each cross-attention
reads one copy of its input's keys for all of its beams), and `SharedCacheDecoder` runs it: one buffer per cache
tensor as long as the call's output, bound once as the step's input and output (IO binding to numpy arrays), into
which the kernel writes each new key and value at `past_sequence_length`; beams read their history through
`cache_indirection` (batch, beams, max_len: the beam whose row holds each position), so a reorder is a small int32
gather. Buffers are reused between calls (`BufferPool`): fresh ones page-fault every 4 KiB on every call.

Needs the `onnx` package installed, for its message classes alone (`onnxproto`: the process does not import onnx,
12-15 MB resident); the weights are read by ONNX Runtime from the stored file,
mapped into memory (see `Rewritten`; the dir on disk keeps the layout optimum, Triton and the quantizer read). fp16
and in-flight graphs, exports whose attention is laid out otherwise (older ones, other tools'), and graphs over
`MAX_BYTES` run as stored. The rewritten graph still runs a step of the stored layout (`SharedGraph.run`: the
cache copied into a buffer one slot longer), so calibration and the one-thread step timing read it like any graph.
"""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from t5compress.names import DECODER_WITH_PAST, ENCODER, ONNX_SUFFIX
from t5compress.onnxgraph import weightless
from t5compress.onnxproto import DTYPES, messages, parse, tensor_type, to_array
from t5compress.runtime.firststep import FOLDER
from t5compress.runtime.hugepages import trim_heap
from t5compress.runtime.lazyrows import Fills, LazyRows
from t5compress.runtime.stepgraph import BEAM_WIDTH, INDIRECTION, PAST_LEN, per_input_cross, rewrite, row_lookups

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 30  # larger with-past graphs run as stored: the rewrite was never tried on one
ENV = "T5COMPRESS_SHARED_CACHE"  # 0: run with-past graphs as stored


@dataclass
class Rewritten:
    """A dir's with-past graph rewritten for the shared cache, what `SharedGraph` opens sessions from: the graph
    without its weights (`onnxgraph.weightless`: a few hundred KB, its initializers naming their bytes in the
    stored file by offset). Where every weight it names lives in the dir's own data files (`weights.onnx_data`, a
    dir that stores each weight once), ONNX Runtime finds them there (`FOLDER`) and maps them as it does for a graph
    opened from its path (the arrays made here are declared by their sources' bytes: `_attach`); where some live in
    the graph file itself (optimum's layout), the files are handed to it mapped, as in-memory external data files
    (it takes all or none), which it copies from while it opens a session: a transient copy of the graph's weights
    (t5-base static int8's with-past step opened alone: peak 351 against 206 MB from the path). Nothing is written
    anywhere, and the weights are never parsed or serialised by the onnx package (flan-t5-small fp32: 0.8-1.0 s at
    load when they were, through a temporary file). `load_runtime` makes it before it notes the process's memory
    regions for huge pages (a file mapping is not one of them) and drops it once the sessions are open.

    The lookup tables by row (`stepgraph.row_lookups`' of a tied int8 table stored by column, and a stored table
    that lookups gather rows of, an untied embedding: `_row_tables`) are held by the rows looked up, filled from
    the stored table as ids are first seen (`runtime.lazyrows`: `fills`), and every session that reads one is given
    the same array (`SessionOptions.add_initializer`, which ONNX Runtime reads in place), the encoder's lookups
    included where they gather from the same stored table (`encoder`): a tied t5-small int8 table is 16 MB, which
    the encoder otherwise read column by column from a mapping of its own."""

    path: Path  # the export dir
    model: bytes  # the rewritten graph, its large initializers external
    weights: dict[str, object]  # external data location -> its bytes (a file mapped, or an array made here)
    cross_per_input: bool
    first: tuple | None = None  # `runtime.firststep.cross_graph`: the first step runs on this graph, not decoder_model
    tables: dict[str, np.ndarray] = field(default_factory=dict)  # the lookup tables made at load, by initializer
    encoder: tuple | None = None  # (graph, weights, tables) of the encoder, its lookups on `tables`' arrays
    fills: Fills | None = None  # the lazy tables among `tables`: filled before every run that reads them

    def session(self, options):
        return _session_over(self.model, self.weights, self.tables, options, self.path)

    def encoder_session(self, options):
        """A session of the encoder whose lookups read the with-past graph's tables, or None (see `_encoder`)."""
        return _session_over(*self.encoder, options, self.path) if self.encoder is not None else None


def _session_over(model: bytes, weights: dict, tables: dict, options, folder: Path):
    """A CPU session of `model`: its external data read from the dir `folder`'s files, or, where it names bytes of
    its own (WEIGHTS: the graph file's, arrays made at load), copied from `weights`; `tables` (initializer name ->
    array) it reads in place, and the session holds them (`t5compress_tables`) as long as it lives."""
    import onnxruntime as ort

    if any(name.startswith(WEIGHTS) for name in _locations(parse(model))):  # ONNX Runtime takes all or none
        names, data = list(weights), list(weights.values())
        options.add_external_initializers_from_files_in_memory(names, data, [len(d) for d in data])
    else:
        options.add_session_config_entry(FOLDER, str(folder))
    values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in tables.items()}
    for name, value in values.items():
        options.add_initializer(name, value)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    session.t5compress_tables = values  # each OrtValue holds its array
    for data in weights.values():  # the pages of the mapped files it copied from, unmapped (they stay cached)
        if hasattr(data, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            data.madvise(mmap.MADV_DONTNEED)
    trim_heap()  # and the weights' copies it freed once packed: neither held while the next session opens
    return session


WEIGHTS = "t5compress-sharedkv-weights"  # the stored file, as the rewritten graph's external data names it


def rewritten(path: Path) -> Rewritten | None:
    """The dir's decoder_with_past_model rewritten (`runtime.stepgraph`), or None where that does not apply (see
    the module docstring; the reason is logged)."""
    import os

    file = path / f"{DECODER_WITH_PAST}{ONNX_SUFFIX}"
    if os.environ.get(ENV, "1") == "0" or not file.is_file():
        return None
    try:
        messages()  # the rewrite's; `_weightless` parses with it
    except ImportError:
        log.info("shared cache: the onnx package is not installed: %s runs as stored", file)
        return None
    try:
        model, weights = _weightless(path, file)
        size = file.stat().st_size + _named_bytes(model)
        if size > MAX_BYTES:
            log.info("shared cache: %s is %d MB, over %d MB: run as stored", file, size >> 20, MAX_BYTES >> 20)
            return None
        layers = rewrite(model)
        cross = per_input_cross(model) if layers else 0
        lazy: list[LazyRows] = []
        rows = {name: (place, _lazy(t, weights, lazy)) for name, (place, t) in _row_tables(model).items()}
        tables = row_lookups(model, lambda t: _array(t, weights), lambda t: _lazy(t, weights, lazy, True)) \
            if layers else {}
        made = {id(t.array) for t in lazy}
        tables = {n: a if a.base is None or id(a) in made else a.copy()  # kept: not views of a mapping
                  for n, a in tables.items()}
        weights |= _attach(model, tables)
        tables |= {name: array for name, (_, array) in rows.items()}  # read in place, by every session
    except Exception as e:  # a damaged or partial graph: opening it as stored says what is wrong, in one line
        log.info("shared cache: %s not rewritten (%s): run as stored", file, e)
        return None
    if not layers:
        log.info("shared cache: %s does not have the exported self-attention pattern: run as stored", file)
        return None
    log.info("shared cache: %d self-attention layers of %s on DecoderMaskedMultiHeadAttention, %s%s", layers, file,
             "the cross-attention cache per input" if cross else "the cross-attention cache per beam",
             f", {len(tables)} lookup tables by row" if tables else "")
    from t5compress.runtime.firststep import cross_graph

    return Rewritten(path, model.SerializeToString(), weights, cross > 0, cross_graph(path), tables,
                     _encoder(path, tables, weights, dict(rows.values()), lazy), Fills(lazy) if lazy else None)


def _lazy(tensor, weights: dict, made: list, transposed: bool = False) -> np.ndarray:
    """The (vocab, d) rows of a stored table (`transposed`: stored (d, vocab)), filled as ids are looked up
    (`lazyrows.LazyRows`, appended to `made`)."""
    where = _external(tensor)
    mapping = weights.get(where.get("location")) if where else None
    made.append(LazyRows(_array(tensor, weights), transposed, mapping, int(where.get("offset", 0))))
    return made[-1].array


def _weightless(path: Path, file: Path, mapped: dict | None = None):
    """(the graph of `file`, parsed without its weights, as `onnxgraph.weightless` gives it; its external data
    files mapped, by location: those in `mapped` reused, so that a page read for two graphs is mapped once).
    Needs the onnx package installed (`onnxproto`)."""
    weights = {WEIGHTS: _mapped(file)}
    model = parse(weightless(memoryview(weights[WEIGHTS]), WEIGHTS))
    mapped = mapped or {}
    return model, weights | {loc: mapped.get(loc) or _mapped(_inside(path, loc))
                             for loc in _locations(model) - {WEIGHTS}}


def _encoder(path: Path, tables: dict, mapped: dict, rows: dict, lazy: list) -> tuple | None:
    """(graph, weights, tables) of the dir's encoder, each of its embedding lookups gathering rows of the one of
    `tables` made from a stored table of the same values (`row_lookups`; `lazy`, the with-past step's
    `lazyrows.LazyRows`) or, for a table stored by rows, the same stored bytes (`rows`: their place in the dir's
    files -> the with-past step's array), its ids' scales from the one of `tables` of the same values; or None
    where it has no such lookup or one has no equal. `mapped`: the with-past graph's weights, whose mapped files it
    reuses."""
    file = path / f"{ENCODER}{ONNX_SUFFIX}"
    if not tables or not file.is_file():
        return None

    def step_rows(tensor):  # the with-past step's rows of a stored table holding the same values
        source = _array(tensor, weights)
        return next((t.array for t in lazy if t.transposed and t.source.shape == source.shape
                     and t.source.dtype == source.dtype and (t.source.ctypes.data == source.ctypes.data
                                                             or np.array_equal(t.source, source))), None)

    try:
        model, weights = _weightless(path, file, mapped)
        stored = {name: rows.get(place) for name, (place, _) in _row_tables(model).items()}
        own = row_lookups(model, lambda t: _array(t, weights), step_rows)
    except Exception as e:  # the encoder opens as stored, which names what is wrong
        log.info("shared cache: %s lookups not rewritten (%s): opened as stored", file, e)
        return None
    same = {name: a if a is None or any(a is t for t in tables.values()) else
            next((t for t in tables.values() if t.shape == a.shape and t.dtype == a.dtype and np.array_equal(t, a)),
                 None) for name, a in own.items()}
    same |= {name: a for name, a in stored.items() if a is not None}
    if not same or any(t is None for t in same.values()):
        return None
    weights |= _attach(model, same)
    read = {x for node in model.graph.node for x in node.input}
    unread = [t for t in model.graph.initializer if t.name not in read]  # the column tables: never copied at load
    for t in unread:
        model.graph.initializer.remove(t)
    return model.SerializeToString(), weights, same


def _named_bytes(model) -> int:
    """Bytes of the external data the graph's initializers name in the dir's files (each place once): its own data
    file in optimum's layout, its share of weights.onnx_data in a dir that stores each weight once (`onnxstore`)."""
    places = {}
    for t in model.graph.initializer:
        entry = _external(t)
        if entry and entry.get("location") != WEIGHTS:  # WEIGHTS: the graph file's own bytes, counted apart
            places[entry.get("location"), entry.get("offset")] = int(entry.get("length") or 0)
    return sum(places.values())


def _array(tensor, weights: dict) -> np.ndarray:
    """An initializer's value, read where its bytes are (inline, or in one of `weights`' files)."""
    if tensor.data_location != tensor.EXTERNAL:
        return to_array(tensor)
    where = _external(tensor)
    dtype = DTYPES[tensor.data_type]
    count = int(np.prod(tensor.dims, dtype=np.int64))
    data = np.frombuffer(weights[where["location"]], dtype, count, int(where.get("offset", 0)))
    return data.reshape(tuple(tensor.dims))


def _attach(model, arrays: dict) -> dict:
    """Add `arrays` (`row_lookups`' tables, named `SOURCE/rows` or `SOURCE/column` after the initializer each was
    made from) to the model as initializers, so that the serialised graph stays small; returns the in-memory files
    this needs, by name (for `Rewritten.weights`). The session gets each array itself (`add_initializer`, read in
    place), so an initializer here only has to declare it: where its source holds the same number of bytes in the
    dir's own files, it names those bytes (with the array's shape), and ONNX Runtime can read every weight from the
    dir's files (`_session_over`); otherwise its bytes are an in-memory file of their own."""
    files = {}
    inits = {t.name: t for t in model.graph.initializer}
    for i, (name, a) in enumerate(arrays.items()):
        if name in inits:  # a stored table (`_row_tables`): the graph declares it already
            continue
        a = np.ascontiguousarray(a)
        source = inits.get(name.rsplit("/", 1)[0])
        if source is not None and _file_bytes(source) == a.nbytes and source.data_type == tensor_type(a.dtype):
            t = model.graph.initializer.add()
            t.CopyFrom(source)
            t.name = name
            del t.dims[:]
            t.dims.extend(a.shape)
            continue
        t = model.graph.initializer.add()
        t.name, t.data_type = name, tensor_type(a.dtype)
        t.dims.extend(a.shape)
        location = f"{WEIGHTS}-added-{i}"
        for key, v in (("location", location), ("offset", "0"), ("length", str(a.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, v
        t.data_location = t.EXTERNAL
        files[location] = a.reshape(-1).view(np.uint8)
    return files


ROW_TABLE_BYTES = 1 << 20  # a stored lookup table this large is read in place and shared (`_row_tables`)


def _row_tables(model) -> dict:
    """The stored tables the graph's lookups gather rows of (Gather on axis 0 of an initializer of at least
    `ROW_TABLE_BYTES` in the dir's own files, that no other node reads: an untied embedding; a table a tied LM head
    also reads must stay whole), by name: (their place in the files, the initializer). Given to the sessions as one
    array (`add_initializer`, filled as ids are looked up), it serves the encoder and the with-past step: opened
    apart, ONNX Runtime maps each graph's weights itself, and a lookup's pages fault in 64 KiB around each row read,
    so in time each session held the table (flan-t5-small int8: 32 MB of the file resident after eleven batch-8
    calls, 17 MB with one mapped array)."""
    inits = {t.name: t for t in model.graph.initializer}
    found, other = {}, set()
    for node in model.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        lookup = node.op_type == "Gather" and axis == 0 and len(node.input) == 2 and node.input[1] not in inits
        t = inits.get(node.input[0]) if lookup else None  # constant ids: ONNX Runtime may fold it at load
        other |= set(node.input[1:] if t is not None else node.input)
        if t is not None and (_file_bytes(t) or 0) >= ROW_TABLE_BYTES and len(t.dims) == 2:
            where = _external(t)
            place = (where["location"], int(where.get("offset", 0)), int(where["length"]))
            found[t.name] = (place, t)
    return {name: v for name, v in found.items() if name not in other}  # a table the lookups alone read


def _external(tensor) -> dict[str, str]:
    """An initializer's external data entries (location, offset, length), empty when its bytes are inline."""
    return {e.key: e.value for e in tensor.external_data} if tensor.data_location == tensor.EXTERNAL else {}


def _file_bytes(tensor) -> int | None:
    """How many bytes of the dir's own data files an initializer names (None: inline, or in the graph file)."""
    where = _external(tensor)
    if not where or where.get("location", "").startswith(WEIGHTS) or "length" not in where:
        return None
    return int(where["length"])


def _mapped(file: Path):
    """The file's bytes, mapped read-only (an empty file, which cannot be mapped: empty bytes)."""
    with open(file, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""


def _locations(model) -> set[str]:
    """The external data files the graph's initializers name."""
    return {e.value for t in model.graph.initializer if t.data_location == t.EXTERNAL
            for e in t.external_data if e.key == "location"}


def _inside(path: Path, location: str) -> Path:
    """An external data file of the dir; a location outside it (absolute, or through ..) is refused."""
    file = (path / location).resolve()
    if Path(location).is_absolute() or not file.is_relative_to(path.resolve()) or not file.is_file():
        raise ValueError(f"external data {location!r} is not a file inside {path}")
    return file


def open_shared(path: Path, options) -> SharedGraph | None:
    """The dir's with-past graph as a `SharedGraph` with ONNX Runtime session `options`, or None (see `rewritten`)."""
    done = rewritten(path)
    return SharedGraph(done, options) if done is not None else None


class SharedGraph:
    """A rewritten with-past graph: a session over a shared cache, which also runs steps of the stored layout."""

    shared_cache = True

    def __init__(self, done: Rewritten, options):
        self.name, self.path = DECODER_WITH_PAST, done.path
        self.cross_per_input = done.cross_per_input  # fed one cross-attention cache and mask row per input
        self.pool = BufferPool()
        self.fills = done.fills  # the lazy lookup tables: filled with a run's ids first
        self.session = done.session(options)
        extra = (PAST_LEN, BEAM_WIDTH, INDIRECTION)
        self.input_names = tuple(i.name for i in self.session.get_inputs() if i.name not in extra)
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.past = {i.name: (i.shape[1], i.shape[3]) for i in self.session.get_inputs()
                     if i.name.startswith("past_key_values.") and ".decoder." in i.name}  # name -> (heads, d_kv)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A step of the stored layout: the cache (rows, heads, P, d_kv) in, the grown cache out."""
        full = {n: feeds[n] for n in self.input_names if n not in self.past}
        rows, _, length, _ = feeds[next(iter(self.past))].shape
        for n in self.past:
            full[n] = np.zeros((*feeds[n].shape[:2], length + 1, feeds[n].shape[3]), np.float32)
            full[n][:, :, :length] = feeds[n]
        full[PAST_LEN], full[BEAM_WIDTH] = np.array([length], np.int32), np.array([1], np.int32)
        full[INDIRECTION] = np.zeros((rows, 1, length + 1), np.int32)
        if self.fills is not None:
            self.fills.fill(full["input_ids"])
        return dict(zip(self.output_names, self.session.run(None, full), strict=True))


def is_shared(graph) -> bool:
    """Whether `graph` runs over a shared cache."""
    return bool(getattr(graph, "shared_cache", False))


class BufferPool:
    """Cache and logits buffers kept between calls, by shape. Fresh arrays of a few MB cost a page fault for every
    4 KiB page the first time it is written, in every call: 7% of a batch-32 greedy call of the demo fixture."""

    def __init__(self, sets: int = 4):
        self.sets, self.free = sets, []  # (shapes, arrays), the most recently given back last
        self.lock = threading.Lock()

    def take(self, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        """float32 arrays of `shapes`, their contents undefined (a step reads only positions it wrote before)."""
        with self.lock:
            for i, (have, arrays) in enumerate(self.free):
                if have == shapes:
                    del self.free[i]
                    return arrays
        return [np.empty(shape, np.float32) for shape in shapes]

    def give(self, arrays: list[np.ndarray]) -> None:
        with self.lock:
            self.free.append(([a.shape for a in arrays], arrays))
            del self.free[: -self.sets]


class SharedCacheDecoder:
    """`CachedDecoder`'s contract (step, reorder, keep) over a `SharedGraph`: the self-attention cache is one buffer
    per tensor of `max_length` positions, written in place; beams reorder through `cache_indirection`.

    Every input and output is bound once per call (to numpy arrays, by address), so a step is one
    `run_with_iobinding` after writing the new tokens into the bound ids array. The logits returned are a view of
    the bound output buffer: valid until the next step.
    """

    def __init__(self, backend, hidden: np.ndarray, mask: np.ndarray, beams: int, max_length: int):
        self.backend, self.graph = backend, backend.decoder_with_past
        self.hidden: np.ndarray | None = hidden  # (batch, enc_len, d_model)
        self.mask, self.beams, self.max_length = mask, beams, max_length
        self.buffers: dict[str, np.ndarray] = {}  # past name -> (rows, heads, max_length, d_kv)
        self.cross: dict[str, np.ndarray] = {}  # past name -> (rows or inputs, heads, enc_len, d_kv)
        self.past_len = np.zeros(1, np.int32)
        self.per_input = self.graph.cross_per_input  # the cross-attention cache and the mask: a row per input
        self.pool = self.graph.pool
        self.owned: list[np.ndarray] = []  # the pool's arrays this call holds (cache buffers, logits)
        self.io = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch*beams,) int64 -> logits (batch*beams, vocab) float32."""
        if self.io is None:
            return self._first(tokens[:: self.beams])
        self.ids[:, 0] = tokens
        if self.graph.fills is not None:
            self.graph.fills.fill(tokens)
        self.session.run_with_iobinding(self.io)
        self.past_len += 1
        return self.logits[:, 0, :]

    def _first(self, tokens: np.ndarray) -> np.ndarray:
        out = self.backend.decoder.run(
            {"input_ids": tokens[:, None], "encoder_hidden_states": self.hidden, "encoder_attention_mask": self.mask})
        self.hidden = None
        expand = (lambda a: np.repeat(a, self.beams, axis=0)) if self.beams > 1 else (lambda a: a)
        rows = tokens.shape[0] * self.beams
        own = {n.replace("present.", "past_key_values.", 1): v for n, v in out.items() if ".decoder." in n}
        shapes = [(rows, v.shape[1], self.max_length, v.shape[3]) for v in own.values()]
        self.owned = self.pool.take([*shapes, (rows, 1, out["logits"].shape[-1])])  # given back by `close`
        for (name, value), buf in zip(own.items(), self.owned, strict=False):
            buf[:, :, : value.shape[2]] = expand(value)
            self.buffers[name] = buf
            self.past_len[0] = value.shape[2]
        for name, value in out.items():
            if ".encoder." in name:  # graph outputs, ours to compact in place in `keep`
                past = name.replace("present.", "past_key_values.", 1)
                self.cross[past] = np.ascontiguousarray(value if self.per_input else expand(value))
        self.mask = np.array(self.mask if self.per_input else expand(self.mask))  # a copy: `keep` writes into it
        self.indirection = np.zeros((tokens.shape[0], self.beams, self.max_length), np.int32)
        self.logits = self.owned[-1]
        self._bind(rows)
        return expand(out["logits"][:, -1, :].astype(np.float32, copy=False))

    def _bind(self, rows: int) -> None:
        self.session = self.graph.session
        self.ids = np.zeros((rows, 1), np.int64)
        self.width = np.array([self.beams], np.int32)
        io = self.session.io_binding()
        arrays = {"input_ids": self.ids, "encoder_attention_mask": self.mask, PAST_LEN: self.past_len,
                  BEAM_WIDTH: self.width, INDIRECTION: self.indirection, **self.cross, **self.buffers}
        for name, a in arrays.items():
            io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        for name, a in (("logits", self.logits), *((n.replace("past_key_values.", "present.", 1), b)
                                                   for n, b in self.buffers.items())):
            io.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        self.io = io

    def close(self, keep: bool = True) -> None:
        """Give the cache buffers back for the next call (the runtime calls this when the search is done; `keep`
        False: to the system instead, with the call), and unmap the stored tables' pages this call's lookups read
        (`lazyrows`)."""
        if self.graph.fills is not None:
            self.graph.fills.drop()
        if self.io is not None:
            if keep:
                self.pool.give(self.owned)
            self.io, self.buffers, self.owned = None, {}, []

    def reorder(self, rows: np.ndarray) -> None:
        """rows: (batch*beams,) new parent of each beam: the indirection, not the cache, follows the parents."""
        last = int(self.past_len[0]) - 1  # the position each row's own step wrote last
        self.indirection[:, :, last] = np.arange(self.beams)
        parents = rows.reshape(-1, self.beams) % self.beams
        self.indirection[:, :, : last + 1] = np.take_along_axis(
            self.indirection[:, :, : last + 1], parents[:, :, None], axis=1)

    def keep(self, rows: np.ndarray) -> None:
        """rows: (kept,) rows to go on with, ascending (greedy: beams is 1); every per-row array is compacted in
        place (the kept rows moved to its front, only the filled positions of the cache) and bound anew."""
        k, filled = rows.shape[0], int(self.past_len[0])
        for n, b in self.buffers.items():
            b[:k, :, :filled] = b[rows, :, :filled]  # numpy gathers the right-hand side first
            self.buffers[n] = b[:k]
        for n, c in self.cross.items():
            c[:k] = c[rows]
            self.cross[n] = c[:k]
        self.mask[:k] = self.mask[rows]
        self.mask, self.logits = self.mask[:k], self.logits[:k]
        self.indirection = np.ascontiguousarray(self.indirection[rows])
        self._bind(k)
