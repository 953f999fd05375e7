"""Generation inside ONNX Runtime: one call of `generator.onnx` (see `export.generator`) per batch.

The search runs in ONNX Runtime's `BeamSearch` operator (greedy is one beam with no length penalty: a row that
picks EOS ends there, as in greedy search), so the host does no per-step work. Settings map onto the operator's
inputs; the two it fixes when the graph is built (early_stopping, no_repeat_ngram_size) must match what was built,
and a single EOS id is required. The sequences come back as the Python search returns them (`finish`): EOS put back
where the operator left it out, padded as that search pads, cropped to the longest row. One reading differs: a pad
id the model generated before EOS ends the row there (T5 models do not generate their pad id, which is also the
decoder start token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from t5compress.errors import ConfigError, ModelError
from t5compress.names import GENERATOR, MANIFEST_FILE, ONNX_SUFFIX
from t5compress.runtime.search import fill_value
from t5compress.runtime.sessions import Graph, OnnxGraph
from t5compress.runtime.settings import GenerationSettings, SpecialTokens

SEARCHES = ("python", "graph")  # where the search loop runs: numpy on the host, or ONNX Runtime's operator


def generator_entry(path: Path, with_file: bool = True) -> dict:
    """What graphs.json records of the dir's generator.onnx; a one-line error when the dir has none (`with_file`:
    the file must be there too; a Triton text model reads the entry and calls the graph in another model)."""
    manifest = path / MANIFEST_FILE
    entry = json.loads(manifest.read_text()).get(GENERATOR) if manifest.is_file() else None
    if entry is None or (with_file and not (path / f"{GENERATOR}{ONNX_SUFFIX}").is_file()):
        raise ModelError(f"--search graph: '{path}' has no {GENERATOR}{ONNX_SUFFIX}; export with "
                         "`t5compress export ... --search-graph` (quantize then keeps it in int8), or use --search "
                         "python")
    return entry


class GraphSearch:
    """`generate` through a generator graph: an ONNX Runtime session on the dir's generator.onnx (`open`), or
    anything with the `Graph` interface that runs it (a Triton model over BLS)."""

    def __init__(self, fixed: dict, graph: Graph):
        self.fixed = fixed  # graphs.json's generator entry: what the graph was built with
        self.graph = graph

    @classmethod
    def open(cls, path: Path, threads: int, providers: Sequence[str] | None = None) -> GraphSearch:
        return cls(generator_entry(path), OnnxGraph(path / f"{GENERATOR}{ONNX_SUFFIX}", threads, providers))

    def check(self, s: GenerationSettings) -> None:
        """One line for a setting the built graph cannot honour."""
        for name in ("early_stopping", "no_repeat_ngram_size"):
            asked, built = getattr(s, name), self.fixed[name]
            if asked != built:
                raise ConfigError(f"--search graph: {name} {asked!r} asked, the dir's {GENERATOR}{ONNX_SUFFIX} was "
                                  f"built with {built!r}; use --search python, or rebuild it with that setting in "
                                  "generation_config.json")

    def generate(self, input_ids: np.ndarray, mask: np.ndarray, s: GenerationSettings,
                 tok: SpecialTokens) -> np.ndarray:
        """(batch * num_return_sequences, out_len) int64, as `Seq2SeqRuntime.generate` returns."""
        self.check(s)
        feeds = {
            "input_ids": input_ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
            "max_length": np.array([s.max_length], np.int32), "min_length": np.array([s.min_length], np.int32),
            "num_beams": np.array([s.num_beams], np.int32),
            "num_return_sequences": np.array([s.num_return_sequences], np.int32),
            # Greedy has no length penalty. The operator's one beam has: with it, a continuation past the EOS that
            # greedy picks can score higher per token than the row ended there, and the operator returns that one.
            "length_penalty": np.array([s.length_penalty if s.num_beams > 1 else 0.0], np.float32),
            "repetition_penalty": np.array([s.repetition_penalty], np.float32),
        }
        seqs = self.graph.run(feeds)["sequences"].astype(np.int64)
        return finish(seqs.reshape(-1, seqs.shape[-1]), s, tok)


def finish(seqs: np.ndarray, s: GenerationSettings, tok: SpecialTokens) -> np.ndarray:
    """The operator's rows as the Python search returns them. The operator leaves a hypothesis's EOS out and pads
    after it, so the first pad id after the start token marks where EOS was (a row without one ran to max_length):
    EOS goes back there, the rest is padded as the Python search pads (greedy: pad id; beam: transformers' fill
    value), and the batch is cropped to its longest row."""
    padded = seqs[:, 1:] == tok.pad
    ended = padded.any(axis=1)
    stop = np.where(ended, padded.argmax(axis=1) + 2, seqs.shape[1])  # row length, EOS included
    positions = np.arange(seqs.shape[1])[None, :]
    out = np.where(positions >= stop[:, None], fill_value(tok, s.num_beams), seqs)
    out[ended, stop[ended] - 1] = tok.eos[0]
    return out[:, : int(stop.max())]
