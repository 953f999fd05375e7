"""The first decoder step without a session of its own: the decoder's weights in memory once.

optimum's layout has two decoders, and each ONNX Runtime session pre-packs its own copy of the weights it multiplies
by: `decoder_model` (run once per call, for the first token) held as much memory as `decoder_with_past_model` (every
later step): 71 MB of a loaded t5-small int8 runtime, for one step in 32. A with-past step over an empty
self-attention cache computes what the first step computes, given the cross-attention cache, and that cache is a
small part of `decoder_model` (each layer's cross-attention keys and values from the encoder states). `cross_graph`
cuts that part out of the stored `decoder_model` at load (its weights stay where the dir stores them: ONNX Runtime
maps them from the dir's files), and `FirstStep` runs it, then the with-past graph with an empty cache, under
`decoder_model`'s contract. Calls with more than one token (the quantize stage's teacher-forced checks) open the
stored `decoder_model` on first use. Used with the shared cache (`runtime.sharedkv`, the CPU default);
`T5COMPRESS_FIRST_STEP=decoder` runs `decoder_model` as stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from t5compress.names import DECODER, ONNX_SUFFIX

log = logging.getLogger(__name__)

ENV = "T5COMPRESS_FIRST_STEP"  # decoder: run decoder_model as stored
HIDDEN = "encoder_hidden_states"
FOLDER = "session.model_external_initializers_file_folder_path"  # where a graph loaded from bytes finds its weights


def cross_graph(path: Path) -> tuple[bytes, tuple[str, ...], tuple[str, ...]] | None:
    """(the cross-attention cache graph, decoder_model's input names, its output names) cut from the dir's
    decoder_model, or None where that does not apply (the reason is logged). Needs the onnx package installed
    (`onnxproto`)."""
    if os.environ.get(ENV) == "decoder":
        return None
    from t5compress.onnxproto import extract, parse

    file = path / f"{DECODER}{ONNX_SUFFIX}"
    try:
        model = parse(file.read_bytes())
        inputs = tuple(i.name for i in model.graph.input)
        outputs = tuple(o.name for o in model.graph.output)
        cross = [n for n in outputs if n.startswith("present.") and ".encoder." in n]
        if HIDDEN not in inputs or not cross:
            return None
        sub = extract(model, [HIDDEN], cross)
    except Exception as e:  # a graph whose cross cache needs more than the encoder states: run decoder_model
        log.info("first step: no cross-attention graph cut from %s (%s): decoder_model runs it", file, e)
        return None
    return sub.SerializeToString(), inputs, outputs


class FirstStep:
    """decoder_model's contract (ids, encoder states and mask in; logits and the whole cache out) over the
    cross-attention graph and `past`, a with-past graph that runs steps of the stored layout (`SharedGraph.run`)."""

    def __init__(self, path: Path, cut: tuple[bytes, tuple[str, ...], tuple[str, ...]], past, options,
                 stored: Callable, releasing: Callable):
        """`options`: the ONNX Runtime session options of the cross-attention graph; `stored()` opens the dir's
        decoder_model as stored (a `sessions.OnnxGraph`); `releasing(session)`: the run options of a graph run once
        per call (`sessions.releasing`)."""
        import onnxruntime as ort

        model, self.input_names, self.output_names = cut
        self.name, self.past, self._open = DECODER, past, stored
        options.add_session_config_entry(FOLDER, str(path))
        self.cross = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.cross_names = tuple(o.name for o in self.cross.get_outputs())
        self._stored = None
        self._release = releasing(self.cross)
        self._heads = [(o.shape[1], o.shape[3]) for o in self.cross.get_outputs()]  # (heads, d_kv) of each output

    @property
    def stored(self):
        """The dir's decoder_model as stored, opened when first needed."""
        if self._stored is None:
            self._stored = self._open()
        return self._stored

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = feeds["input_ids"]  # (rows, tokens)
        if ids.shape[1] != 1:  # teacher forcing over a whole sequence: the with-past graph takes one token
            return self.stored.run(feeds)
        cross = dict(zip(self.cross_names, self._cross(feeds[HIDDEN]), strict=True))
        step = {"input_ids": ids, "encoder_attention_mask": feeds["encoder_attention_mask"]}
        for name, (heads, d_kv) in self.past.past.items():  # an empty self-attention cache
            step[name] = np.zeros((ids.shape[0], heads, 0, d_kv), np.float32)
        step.update({n.replace("present.", "past_key_values.", 1): v for n, v in cross.items()})
        out = {**self.past.run(step), **cross}
        return {n: out[n] for n in self.output_names}

    def _cross(self, hidden: np.ndarray) -> list[np.ndarray]:
        """The cross-attention cache of `hidden`, written into arrays of our own: outputs of ONNX Runtime's would be
        regions of the session's arena, which keeps what it held for good (t5-base shape, 8 rows of 512 tokens: a
        302 MB cache); so every region is free as the run ends, and with `sessions.releasing` goes back."""
        rows, length = hidden.shape[:2]
        arrays = [np.empty((rows, heads, length, d_kv), hidden.dtype) for heads, d_kv in self._heads]
        io = self.cross.io_binding()
        io.bind_cpu_input(HIDDEN, np.ascontiguousarray(hidden))
        for name, a in zip(self.cross_names, arrays, strict=True):
            io.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        self.cross.run_with_iobinding(io, self._release)
        return arrays
