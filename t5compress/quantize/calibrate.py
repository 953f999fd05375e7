"""Calibration: what each exported graph really sees while the runtime generates from real text, folded into
fixed-size statistics as it passes.

The encoder gets the tokenized calibration texts; the first decoder step gets the encoder output; every later step
gets the real past keys and values of the steps before it. Each graph runs as one ONNX Runtime session of itself
augmented with the tensors its statistics read (`TapGraph`), and generation runs through those sessions: the weights
are loaded once, and every step is computed once. A statistic folds each run into a state whose size does not depend
on the data (a running min / max, a histogram, a sum of X^T X, a per-channel max), and a run is split into row chunks
so that its tokens and the extra tensors it returns stay within a budget. Calibration memory is the model plus that
working set, whatever the number of texts or steps (tests/quantize/test_quantize.py measures it; benchmarks/scale.py
on t5-base and flan-t5-large shapes). One array per tensor per fold also means tensors of different lengths are never
stacked, which ONNX Runtime's Entropy and Percentile collectors require.

A statistic is any object with `augment(model) -> [names]` (add nodes to the graph in memory if it wants, and name
the tensors it reads) and `__call__(feeds, values)` (the run's inputs, and those tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from t5compress.errors import DataError
from t5compress.names import DECODER, DECODER_WITH_PAST, ENCODER, GRAPHS
from t5compress.textio import read_lines

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]
TEXT_SUFFIXES = (".txt", ".text")
RUN_TOKENS = 4096  # input tokens per run: bounds the activations (attention scores grow with rows x length^2)
RUN_BYTES = 256 << 20  # what one run may return (full activations for histograms and GPTQ; a first step's cache)


class Statistic(Protocol):
    def augment(self, model) -> list[str]: ...

    def __call__(self, feeds: Feeds, values: Feeds) -> None: ...


def load_texts(src: str | Path, field: str = "source", prefix: str = "", samples: int | None = None) -> list[str]:
    """Calibration inputs: lines of a plain text file, or the source field of any data `train` reads.

    Raises a DataError naming the file when there are fewer than `samples` texts (None: any non-zero number).
    """
    from t5compress.data import DataConfig, load_examples

    path = Path(src)
    if path.suffix.lower() in TEXT_SUFFIXES:
        texts = [line.strip() for _, line in read_lines(path, "calibration file") if line.strip()]
    else:
        # Only the source is needed: reading the target from the same field accepts records without one.
        cfg = DataConfig(source_field=field, target_field=field)
        texts = [e.source for e in load_examples(src, cfg)]
    if not texts:
        raise DataError(f"{src}: no calibration texts")
    if samples is not None and len(texts) < samples:
        raise DataError(f"{src}: {len(texts)} calibration texts, fewer than the {samples} asked for (--samples)")
    return [prefix + t for t in (texts[:samples] if samples else texts)]


class TapGraph:
    """One exported graph, augmented with what its `stats` read, run as the runtime's graph: each run's inputs and
    those tensors go to the statistics, the graph's own outputs to the runtime. A run is split by rows so that it
    computes at most `tokens` tokens and returns at most `budget` bytes (its outputs and the extra tensors)."""

    def __init__(self, graph, stats: Sequence[Statistic], work: Path, threads: int, tokens: int = RUN_TOKENS,
                 budget: int = RUN_BYTES):
        """`graph`: a `sources.Graph` (its weights are read from the structure it parsed already)."""
        import onnx
        import onnxruntime as ort

        from t5compress.quantize.graphs import save_graph
        from t5compress.runtime.sessions import onnx_session, session_options

        path = graph.path
        model = graph.weights()
        self.name, self.stats = path.stem, list(stats)
        self.output_names = tuple(o.name for o in model.graph.output)
        self.reads = [list(s.augment(model)) for s in self.stats]
        extra = [n for n in dict.fromkeys(n for r in self.reads for n in r) if n not in self.output_names]
        model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra)
        tapped = work / f"{path.stem}.tap{id(self):x}.onnx"
        save_graph(model, tapped, external=True)  # one serialised copy less, and ONNX Runtime maps the weights in
        del model
        options = session_options(threads)
        options.enable_cpu_mem_arena = False  # an arena keeps its largest size for good (it grew with the texts)
        # ONNX Runtime's default order ran every reduction after the whole graph, so every activation of every layer
        # was alive at once (an encoder run of 7 x 516 tokens of t5-small: 1.8 GB peak, 0.67 GB in this order)
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        self.session = onnx_session(tapped, options)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.fetch = [*self.output_names, *extra]
        self.tokens, self.budget = tokens, budget
        self.context_bytes: float | None = None  # bytes a run returns per row and encoder token, learnt as it runs
        self.calls = 0

    def run(self, feeds: Feeds) -> Feeds:
        own = {n: feeds[n] for n in self.input_names}
        rows, length = own["input_ids"].shape  # length: the tokens each row computes (1 in a decoder step)
        context = max(v.shape[1] for v in own.values() if v.ndim in (2, 3))  # the encoder's length, in every graph
        merged, i = None, 0
        while i < rows:
            step = min(self._rows(length, context), rows - i)
            part = own if step == rows else {k: v[i:i + step] for k, v in own.items()}
            values = dict(zip(self.fetch, self.session.run(self.fetch, part), strict=True))
            for stat, names in zip(self.stats, self.reads, strict=True):
                stat(part, {n: values[n] for n in names})
            returned = sum(v.nbytes for v in values.values()) / (step * context)
            self.context_bytes = max(self.context_bytes or 0.0, returned)
            if step == rows:
                merged = [values[n] for n in self.output_names]
            else:  # filled in place: concatenating the parts would hold the whole output twice
                if merged is None:
                    merged = [np.empty((rows, *values[n].shape[1:]), values[n].dtype) for n in self.output_names]
                for out, n in zip(merged, self.output_names, strict=True):
                    out[i:i + step] = values[n]
            i += step
        self.calls += 1
        return dict(zip(self.output_names, merged, strict=True))

    def _rows(self, length: int, context: int) -> int:
        """Rows per run: at most `tokens` computed tokens, and at most `budget` bytes returned (outputs and extra
        tensors: the first decoder step returns the whole cross-attention cache); one row until a run has shown
        how many bytes a row returns."""
        if self.context_bytes is None:
            return 1
        by_bytes = self.budget // max(self.context_bytes * context, 1.0)
        return int(max(1, min(self.tokens // length, by_bytes)))


def batches(texts: Sequence[str], size: int) -> Iterator[list[str]]:
    for rows in batch_rows(texts, size):
        yield [texts[j] for j in rows]


def batch_rows(texts: Sequence[str], size: int) -> Iterator[list[int]]:
    """The indices of `texts` in each batch of `batches`."""
    # Sorted by length: padding in a calibration batch would be calibration data no real request has.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for i in range(0, len(order), size):
        yield order[i : i + size]


def drive(src: Path, graphs: dict, texts: Sequence[str], stats: dict[str, list[Statistic]],
          batch_size: int, max_new_tokens: int, work: Path, threads: int = 0,
          progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Generate greedily over `texts` with the export dir `src`'s tokenizer and settings, running each graph from
    `graphs` (`sources.Graph`s: its fp32 graphs, or rewritten ones such as smoothed) with its `stats` tapping it.

    Returns the number of feeds each graph saw. Texts longer than the model's input limit are truncated as
    `generate` truncates them, and said so in one warning."""
    from t5compress.runtime.limits import release_memory
    from t5compress.runtime.model import runtime_over
    from t5compress.runtime.sessions import Backend

    release_memory()  # what rewriting the graphs left (untied, smoothed copies)
    taps = {g: TapGraph(graphs[g], stats.get(g, []), work, threads) for g in GRAPHS}
    runtime = runtime_over(src, Backend("onnx", taps[ENCODER], taps[DECODER], taps[DECODER_WITH_PAST]))
    cut = 0
    for chunk in batches(texts, batch_size):
        enc = runtime.tokenize(chunk)
        cut += sum(enc.truncated)
        runtime.generate(enc.input_ids, enc.attention_mask, max_new_tokens=max_new_tokens, num_beams=1)
        if progress:
            progress(len(chunk))
    if cut:
        log.warning("%d of %d calibration texts are longer than the model's %d-token input limit and were truncated "
                    "to it, as generate does", cut, len(texts), runtime.max_input_tokens)
    calls = {name: tap.calls for name, tap in taps.items()}
    del taps, runtime
    release_memory()  # the sessions and their buffers, before the next phase loads its own
    return calls


class Snapshot:
    """A statistic that keeps a copy of the `at`-th run's inputs (the last one seen if there were fewer)."""

    def __init__(self, at: int = 0):
        self.at, self.seen, self.feeds = at, 0, None

    def augment(self, model) -> list[str]:
        return []

    def __call__(self, feeds: Feeds, values: Feeds) -> None:
        if self.seen <= self.at:
            self.feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}
        self.seen += 1


class Recorder:
    """A statistic that keeps copies of runs' inputs, evenly spread over all it is shown and bounded both in number
    (`limit`) and in bytes (`budget`): when either is exceeded, every other copy is dropped and only every
    second run from then on is kept (the spread stays even, the memory bounded whatever the number of runs)."""

    def __init__(self, limit: int = 64, budget: int = 1 << 30):
        self.limit, self.budget = limit, budget
        self.stride, self.seen, self.feeds = 1, 0, []

    def augment(self, model) -> list[str]:
        return []

    def __call__(self, feeds: Feeds, values: Feeds) -> None:
        if self.seen % self.stride == 0:
            self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
            while len(self.feeds) > 1 and (len(self.feeds) > self.limit or self.nbytes > self.budget):
                self.feeds, self.stride = self.feeds[::2], self.stride * 2
        self.seen += 1

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for f in self.feeds for v in f.values())
