"""Calibration feeds: what each exported graph really sees while the fp32 runtime generates from real text.

The encoder gets the tokenized calibration texts; the first decoder step gets the encoder output; every later step
gets the real past keys and values of the steps before it. A `Tap` wraps a runtime graph and hands each feed to the
sinks registered for that graph (one ONNX Runtime calibrator per graph) before running it, so nothing is stored:
calibration memory stays flat whatever the number of samples or steps. One feed per `collect` call also means tensors
of different lengths never need stacking, which is what ONNX Runtime's Entropy and Percentile calibrators require.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from t5compress.errors import DataError
from t5compress.names import DECODER, DECODER_WITH_PAST, ENCODER
from t5compress.textio import read_lines

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]
Sink = Callable[[Feeds], None]
TEXT_SUFFIXES = (".txt", ".text")


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


class Tap:
    """A runtime graph that shows every feed to its sinks, then runs as before."""

    def __init__(self, graph, sinks: list[Sink]):
        self.graph, self.sinks = graph, sinks
        self.name, self.input_names, self.output_names = graph.name, graph.input_names, graph.output_names
        self.calls = 0

    def run(self, feeds: Feeds) -> Feeds:
        own = {n: feeds[n] for n in self.input_names}
        for sink in self.sinks:
            sink(own)
        self.calls += 1
        return self.graph.run(feeds)


def batches(texts: Sequence[str], size: int) -> Iterator[list[str]]:
    # Sorted by length: padding in a calibration batch would be calibration data no real request has.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for i in range(0, len(order), size):
        yield [texts[j] for j in order[i : i + size]]


def drive(runtime, texts: Sequence[str], sinks: dict[str, list[Sink]], batch_size: int, max_new_tokens: int,
          progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Generate greedily over `texts` with `runtime`, showing each graph's feeds to `sinks[graph]`.

    Returns the number of feeds each graph saw.
    """
    backend = runtime.backend
    taps = {
        ENCODER: Tap(backend.encoder, sinks.get(ENCODER, [])),
        DECODER: Tap(backend.decoder, sinks.get(DECODER, [])),
        DECODER_WITH_PAST: Tap(backend.decoder_with_past, sinks.get(DECODER_WITH_PAST, [])),
    }
    runtime.backend = replace(backend, encoder=taps[ENCODER], decoder=taps[DECODER],
                              decoder_with_past=taps[DECODER_WITH_PAST])
    try:
        for chunk in batches(texts, batch_size):
            ids, mask = runtime.encode(chunk)
            runtime.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=1)
            if progress:
                progress(len(chunk))
    finally:
        runtime.backend = backend
    return {name: tap.calls for name, tap in taps.items()}
