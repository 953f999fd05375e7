"""Decoder steps of few rows on one intra-op thread, where that is measured faster than the session's thread pool.

At one to four rows a with-past step is a chain of matrix-vector products and small nodes, each too short for a
second thread to pay for handing it work. On the 2-vCPU development VMs flan-t5-small static int8 took 118 ms per
greedy call at batch 1 with its steps on one thread against 134 ms on two (beam 4, every graph on one thread: 189
against 203 ms), while at 8 rows two threads won (293 against 322 ms) and an fp32 export gained from two threads at
every size (b1 greedy: 233 ms on two, 266 with the steps on one). So which way a model goes on a machine is
measured, not assumed: when a runtime opens an ONNX export with more than one thread on the CPU, a second, one-thread
session of decoder_with_past is timed against the first on the same one-row step and kept, for steps of up to
`FEW_ROWS` rows, only when it takes under `MARGIN` of the pool's time, twice in a row; otherwise it is closed at
once. (Since the pool's workers spin while a run lasts, `runtime.threads`, the pool has won the one-row step on these
VMs; one timing at load sometimes caught a busy moment and sent all of a process's steps to one thread.) It holds
the with-past weights a second time (flan-t5-small int8: peak memory 338 MB against 268 MB with one session) and
costs its opening (~0.3 s) plus ~0.1-0.2 s of timing at load.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from t5compress.names import DECODER_MASK, DECODER_WITH_PAST, ONNX_SUFFIX
from t5compress.runtime.sessions import Backend, OnnxGraph, in_one_pass, numpy_type, session_options

log = logging.getLogger(__name__)

FEW_ROWS = 4  # steps of up to this many rows go to the one-thread session (8 rows already gained from two threads)
MARGIN = 0.9  # keep that session only when its one-row step takes under 90% of the pool's
PAST, ENC_LEN = 16, 32  # the timed step: a cache of 16 earlier tokens, 32 input tokens


class RowSplitGraph:
    """One graph, two sessions: steps of up to `few_rows` rows run on `few` (one thread), larger ones on `many`."""

    def __init__(self, many: OnnxGraph, few: OnnxGraph, few_rows: int = FEW_ROWS):
        self.many, self.few, self.few_rows = many, few, few_rows
        self.name, self.input_names, self.output_names = many.name, many.input_names, many.output_names
        self.session = many.session  # IO binding and device checks see the thread pool's session

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        graph = self.few if feeds["input_ids"].shape[0] <= self.few_rows else self.many
        return graph.run(feeds)


def step_feeds(graph: OnnxGraph, rows: int = 1) -> dict[str, np.ndarray]:
    """Inputs for one with-past step of `rows` rows (token 0, a full mask, a small random cache of `PAST` tokens)."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {"input_ids": np.zeros((rows, 1), np.int64),
                                    "encoder_attention_mask": np.ones((rows, ENC_LEN), np.int64),
                                    DECODER_MASK: np.ones((rows, PAST + 1), np.int64)}
    for i in graph.session.get_inputs():
        if i.name.startswith("past_key_values."):
            length = PAST if ".decoder." in i.name else ENC_LEN
            heads, d_kv = (d if isinstance(d, int) else 1 for d in i.shape[1::2])
            feeds[i.name] = (rng.standard_normal((rows, heads, length, d_kv)) * 0.1).astype(numpy_type(i.type))
    return {n: feeds[n] for n in graph.input_names}


def step_times(a: OnnxGraph, b: OnnxGraph, repeats: int = 9) -> tuple[float, float]:
    """Median seconds of one one-row step on `a` and on `b`, run in turn (so a load change hits both alike)."""
    feeds = step_feeds(a)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 3):  # three warm-up rounds
        for graph, out in zip((a, b), times, strict=True):
            t = time.perf_counter()
            graph.run(feeds)
            if i >= 3:
                out.append(time.perf_counter() - t)
    return float(np.median(times[0])), float(np.median(times[1]))


def with_few_row_steps(backend: Backend, path: Path, threads: int, margin: float = MARGIN) -> Backend:
    """`backend` with its with-past steps of few rows on a one-thread session when that is faster (see the module
    docstring); `backend` itself when it runs one thread, has no separate with-past session, is opened for one pass
    (`sessions.one_pass`), or the pool is faster."""
    pool = backend.decoder_with_past
    reopen = getattr(pool, "reopen", None)  # a shared-cache graph (runtime.sharedkv) reopens from its rewrite
    if threads == 1 or in_one_pass() or (os.cpu_count() or 1) < 2 or not (isinstance(pool, OnnxGraph) or reopen):
        return backend
    if pool.session.get_providers() != ["CPUExecutionProvider"]:
        return backend
    single = reopen(session_options(1)) if reopen else OnnxGraph(path / f"{DECODER_WITH_PAST}{ONNX_SUFFIX}", 1)
    try:
        timed = [step_times(pool, single)]
        if timed[0][1] < margin * timed[0][0]:  # a busy moment at load can favour either: one thread must win twice
            timed.append(step_times(pool, single))
    except Exception as e:  # onnxruntime raises its own types: a graph the made-up step does not fit keeps one session
        log.info("with-past step not timed (%s): one session", e)
        return backend
    keep = all(few < margin * many for many, few in timed)
    many_s, few_s = timed[-1]
    log.info("with-past step at 1 row: %.2f ms on %s threads, %.2f ms on one: %s", many_s * 1e3, threads or "default",
             few_s * 1e3, f"steps of up to {FEW_ROWS} rows on one thread" if keep else "one session")
    if not keep:
        return backend
    return dataclasses.replace(backend, decoder_with_past=RowSplitGraph(pool, single))
