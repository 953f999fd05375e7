"""A self-attention cache written in place: with-past steps that neither copy the cache nor reorder it for beams.

An exported with-past step (optimum's layout, what the export dir holds) takes the cache as it is and returns it one
token longer: each layer's self-attention runs Concat(past, new) for its keys and for its values, so every step
copies the whole cache, and beam search then gathers the rows of every beam whose parent changed. At batch 8 x beam
4 on flan-t5-small that was 1.5 ms of a 13.7 ms step (the Concats) plus 0.5 ms (the gathers), with the attention's
own small nodes another 1 ms. When a runtime opens such a graph for the CPU, `rewrite` swaps each layer's
self-attention for ONNX Runtime's `DecoderMaskedMultiHeadAttention` (com.microsoft, with CPU kernels) with
`past_present_share_buffer`: the cache is one buffer per tensor of the call's maximum length, bound as input and
output of the step (IO binding), into which the kernel writes the new token's key and value at
`past_sequence_length`; beams read their history through `cache_indirection` (batch, beams, max_len), the beam
whose row holds each position, so reordering beams updates a small int32 array instead of the cache.

The rewrite is exact in what it computes (T5 does not scale its scores; the relative position bias goes in as the
kernel's attention bias, sized by `past_sequence_length`), done in memory with the `onnx` package at load (the dir
on disk keeps the layout optimum, Triton and the quantizer read), and only where every layer matches the pattern the
export writes: fp16, QAT and in-flight graphs, a runtime without `onnx`, and graphs over `MAX_BYTES` run as stored.
The rewritten graph still runs a step of the stored layout (`SharedGraph.run`: the cache copied into a buffer one
slot longer), so calibration and the one-thread step timing read it like any graph.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from t5compress.names import DECODER_MASK, DECODER_WITH_PAST, ONNX_SUFFIX

log = logging.getLogger(__name__)

PAST_LEN, BEAM_WIDTH, INDIRECTION = "past_sequence_length", "beam_width", "cache_indirection"
MAX_BYTES = 1 << 30  # larger graphs are not loaded a second time for the rewrite (protobuf's limit is 2 GiB)
ENV = "T5COMPRESS_SHARED_CACHE"  # 0: run with-past graphs as stored


def rewrite(model) -> int:
    """Swap every decoder layer's self-attention in a with-past `model` (onnx.ModelProto, changed in place) for
    DecoderMaskedMultiHeadAttention over a shared cache; returns the layers rewritten, 0 (and `model` unchanged)
    where any layer does not have the exported pattern."""
    from t5compress.onnxgraph import drop_unused

    g = model.graph
    names = {i.name for i in g.input}
    past = sorted((n for n in names if n.startswith("past_key_values.") and ".decoder." in n), key=_layer)
    if DECODER_MASK in names or not past or any(_elem(g, n) != 1 for n in past):
        return 0
    graph = _Graph(g)
    layers = [graph.layer(past[i], past[i + 1]) for i in range(0, len(past), 2)]
    if any(x is None for x in layers):
        return 0
    shapes = graph.shape_readers(past)
    if shapes is None:
        return 0
    _add_inputs(g)
    dropped = {id(n) for layer in layers for n in layer["drop"]} | {id(n) for n, _, _ in shapes}
    new_first = _shape_nodes(g, shapes)
    by_out = {id(layer["out"]): _attention(layer) for layer in layers}
    nodes = [by_out.get(id(n), n) for n in g.node if id(n) not in dropped or id(n) in by_out]
    del g.node[:]
    g.node.extend(new_first + nodes)
    for v in (*g.input, *g.output):
        if v.name in past or v.name.replace("present.", "past_key_values.", 1) in past:
            v.type.tensor_type.shape.dim[2].dim_param = "max_length"
    drop_unused(g)
    return len(layers)


def _layer(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[1]), parts[3]


def _elem(g, name: str) -> int:
    return next(i.type.tensor_type.elem_type for i in g.input if i.name == name)


class _Graph:
    """Producers, readers and constants of a graph, for matching one layer's self-attention."""

    def __init__(self, g):
        from t5compress.onnxgraph import Index

        self.index = Index(g)
        self.readers: dict[str, list] = {}
        for n in g.node:
            for x in n.input:
                self.readers.setdefault(x, []).append(n)

    def only(self, name: str, op: str, skip: str = "Shape"):
        """The one node of type `op` reading `name` (nodes of type `skip` aside), else None."""
        found = [n for n in self.readers.get(name, []) if n.op_type != skip]
        return found[0] if len(found) == 1 and found[0].op_type == op else None

    def heads(self, reshape) -> tuple[int, int] | None:
        """(heads, d_kv) of a Reshape of (rows, 1, inner) to (rows, heads, 1, d_kv), else None."""
        t = self.index.value(reshape.input[1]) if reshape is not None and reshape.op_type == "Reshape" else None
        return (int(t[1]), int(t[3])) if t is not None and t.size == 4 and t[0] == 0 and t[2] == 1 else None

    def layer(self, key: str, value: str) -> dict | None:
        """One layer's pattern, from its past key and value inputs; None where it differs from the export's."""
        ck, cv = self.only(key, "Concat"), self.only(value, "Concat")
        if ck is None or cv is None or list(ck.input)[:1] != [key] or list(cv.input)[:1] != [value]:
            return None
        present_k, present_v = ck.output[0], cv.output[0]
        kt = self.only(present_k, "Transpose")
        scores = self.only(kt.output[0], "MatMul") if kt is not None else None
        ctx = self.only(present_v, "MatMul")
        if scores is None or ctx is None or list(ctx.input) != [ctx.input[0], present_v]:
            return None
        q, k, v = (self.index.producers.get(x) for x in (scores.input[0], ck.input[1], cv.input[1]))
        hq = self.heads(q)
        if hq is None or hq != self.heads(k) or hq != self.heads(v):
            return None
        chain = self._softmax_chain(scores.output[0], ctx.input[0])
        out = self.only(ctx.output[0], "Reshape", skip="")
        if chain is None or out is None:
            return None
        return {"q": q.input[0], "k": k.input[0], "v": v.input[0], "bias": chain, "heads": hq[0],
                "key": key, "value": value, "present": (present_k, present_v), "out": out,
                "drop": [ck, cv], "name": scores.name.rsplit("/", 1)[0]}

    def _softmax_chain(self, scores: str, probs: str) -> str | None:
        """The bias added to the scores when they reach `probs` through Add, Casts and Softmax only; else None."""
        add = self.only(scores, "Add", skip="")
        if add is None:
            return None
        bias = add.input[1] if add.input[0] == scores else add.input[0]
        x = add.output[0]
        while x != probs:
            found = self.readers.get(x, [])
            if len(found) != 1 or found[0].op_type not in ("Cast", "Softmax"):
                return None
            x = found[0].output[0]
        return bias

    def shape_readers(self, past: list[str]) -> list | None:
        """(Shape node, 'past' or 'present', the past input's name) for each Shape of a self-attention cache
        tensor; None for a Shape with start/end (the export writes none)."""
        found = []
        for name in past:
            present = name.replace("past_key_values.", "present.", 1)
            for which, tensor in (("past", name), ("present", present)):
                for n in self.readers.get(tensor, []):
                    if n.op_type == "Shape":
                        if len(n.attribute):
                            return None
                        found.append((n, which, name))
        return found


def _add_inputs(g) -> None:
    from onnx import TensorProto, helper

    g.input.extend([
        helper.make_tensor_value_info(PAST_LEN, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(BEAM_WIDTH, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(INDIRECTION, TensorProto.INT32, ["batch", "beams", "max_length"]),
    ])


def _shape_nodes(g, shapes: list) -> list:
    """Nodes computing what each Shape of a cache tensor gave, from past_sequence_length: (rows, heads, P, d_kv)
    for the past, P + 1 for the grown cache. The Shape nodes' outputs keep their names."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, values: list[int]):
        g.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    prefix = "/shared_cache"
    nodes = [helper.make_node("Shape", ["input_ids"], [f"{prefix}/rows"], start=0, end=1),
             helper.make_node("Cast", [PAST_LEN], [f"{prefix}/past"], to=TensorProto.INT64),
             helper.make_node("Add", [f"{prefix}/past", const(f"{prefix}/one", [1])], [f"{prefix}/total"])]
    for n, which, past_name in shapes:
        t = next(v for v in g.input if v.name == past_name)
        heads, d_kv = (t.type.tensor_type.shape.dim[i].dim_value for i in (1, 3))
        length = f"{prefix}/past" if which == "past" else f"{prefix}/total"
        name = n.output[0]
        parts = [f"{prefix}/rows", const(f"{name}/heads", [heads]), length, const(f"{name}/d_kv", [d_kv])]
        nodes.append(helper.make_node("Concat", parts, [name], axis=0))
    return nodes


def _attention(layer: dict):
    from onnx import helper

    inputs = [layer["q"], layer["k"], layer["v"], "", layer["bias"], layer["key"], layer["value"],
              PAST_LEN, BEAM_WIDTH, INDIRECTION]
    return helper.make_node(
        "DecoderMaskedMultiHeadAttention", inputs, [layer["out"].output[0], *layer["present"]],
        name=f"{layer['name']}/shared_cache", domain="com.microsoft",
        num_heads=layer["heads"], past_present_share_buffer=1, scale=1.0)


def with_shared_cache(backend, path: Path, threads: int):
    """`backend` with its separate with-past graph rewritten for a shared cache (see `open_shared`); `backend`
    itself where the rewrite does not apply."""
    import dataclasses

    from t5compress.runtime.sessions import OnnxGraph

    if not isinstance(backend.decoder_with_past, OnnxGraph):  # merged decoders: run as stored
        return backend
    shared = open_shared(path, threads)
    return backend if shared is None else dataclasses.replace(backend, decoder_with_past=shared)


def open_shared(path: Path, threads: int):
    """The dir's decoder_with_past_model as a `SharedGraph` on the CPU, or None where the rewrite does not apply
    (see the module docstring; the reason is logged)."""
    import os

    file = path / f"{DECODER_WITH_PAST}{ONNX_SUFFIX}"
    if os.environ.get(ENV, "1") == "0" or not file.is_file():
        return None
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name.startswith(DECODER_WITH_PAST))
    if size > MAX_BYTES:
        log.info("shared cache: %s is %d MB, over %d MB: run as stored", file, size >> 20, MAX_BYTES >> 20)
        return None
    try:
        import onnx
    except ImportError:
        log.info("shared cache: the onnx package is not installed: %s runs as stored", file)
        return None
    model = onnx.load(str(file))
    layers = rewrite(model)
    if not layers:
        log.info("shared cache: %s does not have the exported self-attention pattern: run as stored", file)
        return None
    log.info("shared cache: %d self-attention layers of %s on DecoderMaskedMultiHeadAttention", layers, file)
    return SharedGraph(model.SerializeToString(), threads, path)


class SharedGraph:
    """A rewritten with-past graph: a session over a shared cache, which also runs steps of the stored layout."""

    shared_cache = True

    def __init__(self, model: bytes, threads: int, path: Path):
        import onnxruntime as ort

        from t5compress.runtime.sessions import session_options

        self.name, self.path = DECODER_WITH_PAST, path
        self.session = ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])
        extra = (PAST_LEN, BEAM_WIDTH, INDIRECTION)
        self.input_names = tuple(i.name for i in self.session.get_inputs() if i.name not in extra)
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.past = {i.name: (i.shape[1], i.shape[3]) for i in self.session.get_inputs()
                     if i.name.startswith("past_key_values.") and ".decoder." in i.name}  # name -> (heads, d_kv)

    def reopen(self, threads: int) -> SharedGraph:
        """The same graph on a session of `threads` threads (rewritten again: the bytes are not kept)."""
        return open_shared(self.path, threads)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A step of the stored layout: the cache (rows, heads, P, d_kv) in, the grown cache out."""
        full = {n: feeds[n] for n in self.input_names if n not in self.past}
        rows, _, length, _ = feeds[next(iter(self.past))].shape
        for n in self.past:
            full[n] = np.zeros((*feeds[n].shape[:2], length + 1, feeds[n].shape[3]), np.float32)
            full[n][:, :, :length] = feeds[n]
        full[PAST_LEN], full[BEAM_WIDTH] = np.array([length], np.int32), np.array([1], np.int32)
        full[INDIRECTION] = np.zeros((rows, 1, length + 1), np.int32)
        return dict(zip(self.output_names, self.session.run(None, full), strict=True))


def is_shared(graph) -> bool:
    """Whether `graph` (or both sessions of a row split) runs over a shared cache."""
    return bool(getattr(graph, "shared_cache", False)) or (
        getattr(getattr(graph, "many", None), "shared_cache", False) and graph.few.shared_cache)


def _session(graph, rows: int):
    if hasattr(graph, "few"):  # runtime.steps.RowSplitGraph
        return graph.few.session if rows <= graph.few_rows else graph.many.session
    return graph.session


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
        self.cross: dict[str, np.ndarray] = {}  # past name -> (rows, heads, enc_len, d_kv)
        self.past_len = np.zeros(1, np.int32)
        self.io = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: (batch*beams,) int64 -> logits (batch*beams, vocab) float32."""
        if self.io is None:
            return self._first(tokens[:: self.beams])
        self.ids[:, 0] = tokens
        self.session.run_with_iobinding(self.io)
        self.past_len += 1
        return self.logits[:, 0, :]

    def _first(self, tokens: np.ndarray) -> np.ndarray:
        out = self.backend.decoder.run(
            {"input_ids": tokens[:, None], "encoder_hidden_states": self.hidden, "encoder_attention_mask": self.mask})
        self.hidden = None
        expand = (lambda a: np.repeat(a, self.beams, axis=0)) if self.beams > 1 else (lambda a: a)
        for name, value in out.items():
            past = name.replace("present.", "past_key_values.", 1)
            if ".decoder." in name:
                buf = np.zeros((value.shape[0] * self.beams, value.shape[1], self.max_length, value.shape[3]),
                               np.float32)
                buf[:, :, : value.shape[2]] = expand(value)
                self.buffers[past] = buf
                self.past_len[0] = value.shape[2]
            elif ".encoder." in name:
                self.cross[past] = np.ascontiguousarray(expand(value))
        self.mask = np.ascontiguousarray(expand(self.mask))
        self.indirection = np.zeros((tokens.shape[0], self.beams, self.max_length), np.int32)
        self.vocab = out["logits"].shape[-1]
        self._bind(tokens.shape[0] * self.beams)
        return expand(out["logits"][:, -1, :].astype(np.float32, copy=False))

    def _bind(self, rows: int) -> None:
        self.session = _session(self.graph, rows)
        self.ids = np.zeros((rows, 1), np.int64)
        self.logits = np.empty((rows, 1, self.vocab), np.float32)
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

    def reorder(self, rows: np.ndarray) -> None:
        """rows: (batch*beams,) new parent of each beam: the indirection, not the cache, follows the parents."""
        last = int(self.past_len[0]) - 1  # the position each row's own step wrote last
        self.indirection[:, :, last] = np.arange(self.beams)
        parents = rows.reshape(-1, self.beams) % self.beams
        self.indirection[:, :, : last + 1] = np.take_along_axis(
            self.indirection[:, :, : last + 1], parents[:, :, None], axis=1)

    def keep(self, rows: np.ndarray) -> None:
        """rows: (kept,) rows to go on with (greedy: beams is 1); every per-row array shrinks and is bound anew."""
        self.buffers = {n: b[rows] for n, b in self.buffers.items()}
        self.cross = {n: np.ascontiguousarray(c[rows]) for n, c in self.cross.items()}
        self.mask = np.ascontiguousarray(self.mask[rows])
        self.indirection = np.ascontiguousarray(self.indirection[rows])
        self._bind(rows.shape[0])
