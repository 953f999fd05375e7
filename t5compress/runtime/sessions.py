"""Backends that run the exported graphs: ONNX Runtime sessions, or TorchScript modules.

Both expose the same small interface (`Graph`: input and output names, `run(feeds) -> {name: array}`), so the
generation code never knows which one it drives. An ONNX dir holds either the two decoders (`decoder_model`,
`decoder_with_past_model`: optimum's layout) or the merged one alone (`decoder_model_merged`, weights loaded once);
`MergedStep` presents each branch of the merged graph as the decoder it replaces. Only the TorchScript backend
imports torch, and only when opened: the ONNX path needs numpy and onnxruntime alone.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from t5compress.errors import ConfigError, ModelError, first_line
from t5compress.names import (
    DECODER,
    DECODER_MERGED,
    DECODER_WITH_PAST,
    ENCODER,
    GRAPHS,
    MANIFEST_FILE,
    MERGED_GRAPHS,
    ONNX_SUFFIX,
    TORCHSCRIPT_SUFFIX,
    USE_CACHE_BRANCH,
    graph_io,
)
from t5compress.runtime import threads as threads_mod
from t5compress.runtime.fit import check_export

log = logging.getLogger(__name__)

FORMAT_SUFFIXES = {"onnx": ONNX_SUFFIX, "torchscript": TORCHSCRIPT_SUFFIX}
# Which graph files make a complete dir, per format and decoder layout (first complete one wins).
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "onnx": {"separate": GRAPHS, "merged": MERGED_GRAPHS},
    "torchscript": {"separate": GRAPHS},
}
DECODER_CHOICES = ("auto", "separate", "merged")  # auto: the separate decoders when present, else the merged one


class Graph(Protocol):
    """One exported graph: named numpy inputs in, named numpy outputs out."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Backend:
    """The three graphs of an export directory, opened and ready to run."""

    format: str
    encoder: Graph
    decoder: Graph  # first step: no past in, full cache (self + cross attention) out
    decoder_with_past: Graph  # later steps: one token and the cache in, the grown self-attention cache out


def _feeds_for(graph: Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The arrays `graph` declares, in its order; a missing one is an export the runtime does not understand."""
    try:
        return [feeds[n] for n in graph.input_names]
    except KeyError as e:
        raise ModelError(
            f"graph '{graph.name}' needs input {e.args[0]!r}, which the runtime does not provide: "
            f"not an encoder/decoder/decoder-with-past export in optimum's naming"
        ) from None


def _readable(path: Path) -> None:
    """A ModelError naming a graph file that is missing or unreadable (the loaders would say neither plainly)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or first_line(e))
        raise ModelError(f"cannot read {path.name} in '{path.parent}': {why}") from None


def _damaged(path: Path, what: str, why: str) -> ModelError:
    return ModelError(f"{path.name} in '{path.parent}' is damaged or not {what} file: {why}")


def load_onnx(path: str | Path, load_external_data: bool = True):
    """`onnx.load` behind one guard: every ONNX file the package reads is parsed here, so a truncated or foreign file
    is a one-line ModelError naming it, never a protobuf DecodeError."""
    import onnx

    p = Path(path)
    _readable(p)
    try:
        model = onnx.load(str(p), load_external_data=load_external_data)
    except Exception as e:  # protobuf's DecodeError, onnx's own errors, OSError for missing external data
        raise _damaged(p, "an ONNX", first_line(e)) from e
    if not model.graph.node or not model.opset_import:  # what a file cut at a field boundary parses to
        raise _damaged(p, "an ONNX", "it holds no complete graph")
    return model


def check_onnx(path: str | Path) -> None:
    """A ModelError unless `path` parses as ONNX and the external data files its initializers name hold their bytes
    (the check `t5compress info` makes without loading any weights)."""
    p = Path(path)
    model = load_onnx(p, load_external_data=False)
    sizes: dict[str, int] = {}
    for t in model.graph.initializer:
        if not t.external_data:
            continue
        entry = {e.key: e.value for e in t.external_data}
        where = p.parent / entry.get("location", "")
        if where.name not in sizes:
            if not where.is_file():
                raise _damaged(p, "an ONNX", f"its weights file '{where.name}' is missing")
            sizes[where.name] = where.stat().st_size
        end = int(entry.get("offset") or 0) + int(entry.get("length") or 0)
        if end > sizes[where.name]:
            raise _damaged(p, "an ONNX", f"its weights file '{where.name}' is truncated ({sizes[where.name]:,} "
                                         f"bytes, {end:,} needed)")


def onnx_session(path: str | Path, sess_options=None, providers: Sequence[str] | None = None):
    """`onnxruntime.InferenceSession` behind one guard: a damaged graph file is named, not a traceback."""
    import onnxruntime as ort

    p = Path(path)
    _readable(p)
    try:
        return ort.InferenceSession(str(p), sess_options=sess_options,
                                    providers=list(providers or ["CPUExecutionProvider"]))
    except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, InvalidProtobuf, ...)
        why = first_line(e)
        if "INVALID_PROTOBUF" in why or "Protobuf parsing failed" in why:
            raise _damaged(p, "an ONNX", "ONNX Runtime cannot parse it") from e
        raise ModelError(f"cannot load '{p}' with ONNX Runtime: {why}") from e


TORCHSCRIPT_WARNING = ("TorchScript export: torch.jit.load runs the code its .pt files hold; open only exports you "
                       "trust (ONNX exports hold no code)")


def check_torchscript(path: str | Path) -> None:
    """A ModelError unless `path` is a whole TorchScript archive (a zip whose central directory, at its end, reads):
    a truncated file is named before `torch.jit.load` sees it, and without running anything it holds."""
    import zipfile

    p = Path(path)
    _readable(p)
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise _damaged(p, "a TorchScript", first_line(e)) from None
    if not any(n.endswith("/data.pkl") for n in names):
        raise _damaged(p, "a TorchScript", "a zip archive without TorchScript's data.pkl")


# The encoder on the CPU runs a batch in runs of at most this many tokens (rows x padded length; one row at least):
# its working memory is that of one run, and ONNX Runtime's arena keeps the largest for good. t5-base shape, static
# int8, 8 rows of 512 tokens, 1 thread: the encoder 3.5-3.9 s and +432 MB resident in one run, 3.0-3.2 s and +116 MB
# a row at a time (2 threads: 1.9 s / 1.8 s); at 8 x 128 and 8 x 256 tokens no slower, at the goals' 8 x 32 unchanged.
ENCODER_TOKENS_PER_RUN = 512


class OnnxGraph:
    """An ONNX Runtime session fed only the inputs it declares, with outputs mapped by name."""

    def __init__(self, path: Path, threads: int, providers: Sequence[str] | None = None, session=None,
                 once_per_call: bool = False, fills=None, tokens_per_run: int | None = None):
        """`session`: one the caller opened for `path` (else this opens the file); `once_per_call`: see
        `session_options`; `fills`: the lazy lookup tables it reads (`runtime.lazyrows.Fills`), filled with the
        ids of every run first; `tokens_per_run` (a graph whose every input and output has its rows first, and
        whose rows do not see each other: the encoder): on the CPU, a batch runs in runs of at most that many
        tokens (`ENCODER_TOKENS_PER_RUN`)."""
        self.name, self.fills = path.stem, fills
        self.session = session or onnx_session(path, session_options(threads, once_per_call), providers)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.run_options = releasing(self.session) if once_per_call else None
        self.tokens_per_run = tokens_per_run if _on_cpu(self.session) else None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.fills is not None:
            self.fills.fill(feeds["input_ids"])
        inputs = dict(zip(self.input_names, _feeds_for(self, feeds), strict=True))
        if self.tokens_per_run:
            rows, length = feeds["input_ids"].shape
            step = max(1, self.tokens_per_run // length)
            if step < rows:
                runs = [self.session.run(None, {n: v[i:i + step] for n, v in inputs.items()}, self.run_options)
                        for i in range(0, rows, step)]
                parts = zip(*runs, strict=True)  # each output's parts, run by run
                return {n: np.concatenate(p) for n, p in zip(self.output_names, parts, strict=True)}
        return dict(zip(self.output_names, self.session.run(None, inputs, self.run_options), strict=True))


def _on_cpu(session) -> bool:
    return session.get_providers() == ["CPUExecutionProvider"]


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def numpy_type(onnx_type: str) -> type:
    """The numpy dtype of an ONNX Runtime float input type ('tensor(float16)' -> float16; float32 otherwise)."""
    return _NUMPY_TYPES.get(onnx_type, np.float32)


class MergedStep:
    """One branch of `decoder_model_merged` as a Graph with the inputs and outputs of the decoder it replaces.

    First step (`with_past=False`): the caller's decoder_model feeds, plus zero-length past tensors and
    `use_cache_branch=False`. Later steps: the decoder_with_past_model feeds, plus an empty encoder_hidden_states
    (the with-past branch never reads it, but ONNX Runtime wants every graph input) and `use_cache_branch=True`;
    the cross-attention cache the branch passes through is left out of the outputs, as decoder_with_past_model does.
    """

    def __init__(self, merged: OnnxGraph, with_past: bool):
        self.merged, self.with_past = merged, with_past
        self.name = f"{merged.name} ({'with past' if with_past else 'first step'})"
        inputs = {i.name: i for i in merged.session.get_inputs()}
        if USE_CACHE_BRANCH not in inputs:
            raise ModelError(f"graph '{merged.name}' has no {USE_CACHE_BRANCH} input: not a merged decoder")
        past = tuple(n for n in merged.input_names if n.startswith("past_key_values."))
        filled = ("encoder_hidden_states",) if with_past else past
        # (non-batch dims, dtype) of the empty tensors fed for the branch not taken; unnamed dims get length 0
        self._empty = {n: ([d if isinstance(d, int) else 0 for d in inputs[n].shape[1:]],
                           numpy_type(inputs[n].type)) for n in filled}
        skip = {*filled, USE_CACHE_BRANCH}
        self.input_names = tuple(n for n in merged.input_names if n not in skip)
        self.output_names = tuple(n for n in merged.output_names if not (with_past and ".encoder." in n))
        self._flag = np.array([with_past])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = feeds["input_ids"].shape[0]
        full = dict(zip(self.input_names, _feeds_for(self, feeds), strict=True))
        full.update({n: np.zeros((rows, *dims), dtype) for n, (dims, dtype) in self._empty.items()})
        full[USE_CACHE_BRANCH] = self._flag
        out = self.merged.run(full)
        return {n: out[n] for n in self.output_names}


_one_pass = False  # set by `one_pass`


@contextmanager
def one_pass() -> Iterator[None]:
    """Sessions opened inside give each run's buffers back as it ends (no arena: ONNX Runtime's keeps each session's
    largest working set for good): for runtimes that make one pass over long inputs, where memory counts more than
    speed. The quantize check of a t5-base shape on 16 texts of 512 tokens: its fp32 runtime's peak 4.0 -> 2.5 GB
    (with the one-thread with-past session the runtime then also opened, since removed)."""
    global _one_pass
    before, _one_pass = _one_pass, True
    try:
        yield
    finally:
        _one_pass = before


WORKING_MEMORY = "T5COMPRESS_WORKING_MEMORY"


def releases_working_memory() -> bool:
    """T5COMPRESS_WORKING_MEMORY=release: a call's working memory goes back to the system when the call is done
    (`releasing`); `keep` (the default) keeps it for the next call, which then faults no page in."""
    value = os.environ.get(WORKING_MEMORY, "keep")
    if value not in ("keep", "release"):
        raise ConfigError(f"{WORKING_MEMORY}={value!r}: use 'keep' (the default) or 'release'")
    return value == "release"


def releasing(session):
    """With T5COMPRESS_WORKING_MEMORY=release, for a CPU session with an arena: run options that hand the arena's
    free regions back as each run ends (`memory.enable_memory_arena_shrinkage`), else None. The graphs run once per
    call (the encoder, the first step's cross-attention graph) run with them, with their outputs in arrays of the
    caller's where they can (`firststep.FirstStep`), the with-past step's cache and logits buffers are not kept
    (`sharedkv.SharedCacheDecoder.close`), and the C heap is trimmed after each call. By default an arena keeps a
    session's largest working set for good, and the next call faults none of it in again (a t5-base shape, static
    int8, after a batch-8 call of 512 tokens: 449 MB kept, the encoder run a row at a time, 340 MB released;
    CTranslate2 576-590; released, at 512 tokens batch 8 took 1.02-1.15x the time before the cache buffers went too,
    1.19x after (median of 3 calls, 1.06x the fastest), batch 1 1.01-1.08x; docs/generate.md). The with-past step,
    run once per token, keeps its arena either way."""
    if not (releases_working_memory() and session.get_session_options().enable_cpu_mem_arena and _on_cpu(session)):
        return None
    global _RELEASING
    if _RELEASING is None:
        import onnxruntime as ort

        _RELEASING = ort.RunOptions()
        _RELEASING.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return _RELEASING


_RELEASING = None


def session_options(threads: int, once_per_call: bool = False):
    """Sequential execution on `threads` intra-op threads (0: ONNX Runtime's default, one per physical core); with
    more than one, the workers spin while a run lasts only (`runtime.threads`). `once_per_call`: a graph run once per
    generate call, not per step (see below; and `releasing`). Inside `one_pass`, no arena."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = not _one_pass
    so.intra_op_num_threads = max(threads, 0)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    for key, value in threads_mod.pool_entries(threads).items():
        so.add_session_config_entry(key, value)
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    # Weights copied at load (from in-memory files, `runtime.sharedkv`) and freed once packed go back to the C heap,
    # which is trimmed; in the arena they stayed held (t5-small static int8: 4-6 MB more after load, 2 MB after b8).
    so.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
    # `once_per_call` (the encoder, the first step's cross-attention graph): no memory pattern. ONNX Runtime plans one
    # per set of input shapes and its block stayed in the arena beside what the first run of those shapes allocated
    # (t5-small static int8: a second batch-8 call added 5 MB resident, none without). The with-past step, run once
    # per token, keeps its pattern: with none anywhere, batch-1 greedy CPU time was the same in one paired run and 17%
    # more in another (load 5-9 on 2 cores).
    so.enable_mem_pattern = not once_per_call
    so.log_severity_level = 3  # warnings about unused initializers etc. are noise for users of an export dir
    return so


class TorchScriptGraph:
    """A TorchScript module fed the ONNX graph's inputs positionally; its output tuple is in the ONNX output order."""

    def __init__(self, path: Path, input_names: Sequence[str], output_names: Sequence[str]):
        import torch

        self.name = path.stem
        self._torch = torch
        check_torchscript(path)
        try:  # runs the code the archive holds (TorchScript, not arbitrary Python): the CLI warns about it
            self.module = torch.jit.load(str(path), map_location="cpu").eval()
        except (RuntimeError, OSError, ValueError) as e:
            raise ModelError(f"cannot load '{path}' as TorchScript: {first_line(e)}") from e
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [self._torch.from_numpy(np.ascontiguousarray(a)) for a in _feeds_for(self, feeds)]
        with self._torch.inference_mode():
            out = self.module(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        if len(out) != len(self.output_names):
            raise ModelError(f"graph '{self.name}' returned {len(out)} outputs, expected {len(self.output_names)}")
        return {n: t.numpy() for n, t in zip(self.output_names, out, strict=True)}


def detect_format(path: str | Path) -> str:
    """'onnx' or 'torchscript'; a ModelError naming the missing graph files for anything else.

    An ONNX dir is complete with the encoder and either both separate decoders or the merged decoder.
    """
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"'{p}' is not a directory; pass an export directory (t5compress export MODEL OUT --onnx)")
    partial = None
    for fmt, layouts in LAYOUTS.items():
        suffix = FORMAT_SUFFIXES[fmt]
        present = {g for g in (*GRAPHS, DECODER_MERGED) if (p / f"{g}{suffix}").is_file()}
        if any(set(graphs) <= present for graphs in layouts.values()):
            if fmt == "onnx":
                check_export(p)  # cut short, or graphs of another model: one line before anything is loaded
            return fmt
        if present and partial is None:
            wanted = layouts["merged"] if DECODER_MERGED in present else layouts["separate"]
            partial = [f"{g}{suffix}" for g in wanted if g not in present]
    if partial:
        raise ModelError(f"'{p}' is an incomplete export directory: missing {', '.join(partial)}")
    wanted = ", ".join(f"{g}{ONNX_SUFFIX}" for g in GRAPHS)
    raise ModelError(
        f"'{p}' is not an export directory: missing {wanted} (or {DECODER_MERGED}{ONNX_SUFFIX} in place of the two "
        f"decoders, or the {TORCHSCRIPT_SUFFIX} files)"
    )


def onnx_decoders(path: Path, decoders: str = "auto") -> str:
    """The decoder layout to open: 'separate' or 'merged' (`auto`: separate when both are there, as optimum)."""
    if decoders not in DECODER_CHOICES:
        raise ModelError(f"unknown decoders {decoders!r}; choose one of {', '.join(DECODER_CHOICES)}")
    have = {name for name, graphs in LAYOUTS["onnx"].items() if all((path / f"{g}{ONNX_SUFFIX}").is_file()
                                                                     for g in graphs)}
    if decoders == "auto":
        if not have:
            raise ModelError(f"'{path}' holds no complete ONNX decoder layout (separate or merged)")
        return "separate" if "separate" in have else "merged"
    if decoders not in have:
        wanted = ", ".join(f"{g}{ONNX_SUFFIX}" for g in LAYOUTS["onnx"][decoders])
        raise ModelError(f"'{path}' has no {decoders} decoder graphs: needs {wanted}")
    return decoders


def open_onnx(
    path: Path, threads: int, providers: Sequence[str] | None = None, decoders: str = "auto", shared_cache=None,
) -> Backend:
    """`shared_cache` (CPU only): the dir's decoder_with_past_model as `runtime.sharedkv.rewritten` gave it, run over
    a cache written in place; None: as stored."""

    def graph(name: str) -> OnnxGraph:
        encoder = name == ENCODER
        return OnnxGraph(path / f"{name}{ONNX_SUFFIX}", threads, providers, once_per_call=encoder,
                         tokens_per_run=ENCODER_TOKENS_PER_RUN if encoder else None)

    if onnx_decoders(path, decoders) == "merged":
        merged = graph(DECODER_MERGED)  # one session: the decoder weights are in memory once
        return Backend("onnx", graph(ENCODER), MergedStep(merged, False), MergedStep(merged, True))
    past = first = encoder = None
    if shared_cache is not None and list(providers or ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]:
        from t5compress.runtime.sharedkv import SharedGraph

        past = SharedGraph(shared_cache, session_options(threads))
        lookups = shared_cache.encoder_session(session_options(threads, True))  # one copy of the tied lookup table
        if lookups is not None:
            encoder = OnnxGraph(path / f"{ENCODER}{ONNX_SUFFIX}", threads, session=lookups, once_per_call=True,
                                fills=shared_cache.fills, tokens_per_run=ENCODER_TOKENS_PER_RUN)
        if shared_cache.first is not None:  # the first step on the with-past graph: decoder weights in memory once
            from t5compress.runtime.firststep import FirstStep

            first = FirstStep(path, shared_cache.first, past, session_options(threads, True), lambda: graph(DECODER),
                              releasing)
    return Backend("onnx", encoder or graph(ENCODER), first or graph(DECODER), past or graph(DECODER_WITH_PAST))


def open_torchscript(
    path: Path, threads: int, providers: Sequence[str] | None = None, decoders: str = "auto", shared_cache=None,
) -> Backend:
    import torch

    if decoders not in ("auto", "separate"):
        raise ModelError(f"a TorchScript export has separate decoders only, not {decoders!r}")

    if threads > 0:
        torch.set_num_threads(threads)  # process-wide in torch: there is no per-module setting
    names = torchscript_io_names(path)
    graphs = [TorchScriptGraph(path / f"{g}{TORCHSCRIPT_SUFFIX}", *names[g]) for g in GRAPHS]
    return Backend("torchscript", *graphs)


def torchscript_io_names(path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Positional input names and output names per graph: the export's `graphs.json`, else `names.graph_io`."""
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
            return {g: (list(data[g]["inputs"]), list(data[g]["outputs"])) for g in GRAPHS}
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"'{manifest}' does not list inputs and outputs of {', '.join(GRAPHS)}: {e}") from None
    return {g: (list(ins), list(outs)) for g, (ins, outs) in graph_io(_decoder_layers(path)).items()}


def _decoder_layers(path: Path) -> int:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"'{path}' has no readable config.json: {e}") from None
    return int(cfg.get("num_decoder_layers") or cfg["num_layers"])


BACKENDS: dict[str, Callable[..., Backend]] = {"onnx": open_onnx, "torchscript": open_torchscript}


def open_backend(
    path: str | Path, threads: int = 1, providers: Sequence[str] | None = None, decoders: str = "auto",
    shared_cache=None,
) -> Backend:
    """Open the graphs of an ONNX or TorchScript export directory.

    Args:
        decoders: ONNX only: 'separate', 'merged', or 'auto' (the separate decoders when present, else the merged).
        shared_cache: ONNX on the CPU only: `runtime.sharedkv.rewritten(path)`, the with-past step over a cache
            written in place.
    """
    p = Path(path)
    fmt = detect_format(p)
    log.info("opening %s export %s with %d thread(s)", fmt, p, threads)
    return BACKENDS[fmt](p, threads, providers, decoders, shared_cache)
