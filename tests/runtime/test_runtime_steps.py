"""Few-row decoder steps on a one-thread session (`runtime.steps`): kept only when measured faster, and the tokens
are the one-session runtime's whichever session runs a step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from t5compress.export import ExportConfig, run
from t5compress.runtime import load_runtime, steps
from t5compress.runtime.sessions import OnnxGraph, one_pass, open_backend
from t5compress.runtime.steps import FEW_ROWS, RowSplitGraph, step_feeds, step_times, with_few_row_steps


@pytest.fixture(scope="module")
def export_dir(tiny_gated_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("steps") / "onnx"
    run(tiny_gated_dir, ExportConfig(decoders="both"), out)
    return out


class Counting:
    """A graph that counts the rows of the steps it ran."""

    def __init__(self, graph):
        self.graph, self.rows = graph, []

    def run(self, feeds):
        self.rows.append(feeds["input_ids"].shape[0])
        return self.graph.run(feeds)


def test_split_steps_give_the_one_session_tokens(export_dir):
    plain = load_runtime(export_dir, threads=1)
    split = load_runtime(export_dir, threads=1)  # its backend is replaced below by one split for certain
    split.backend = with_few_row_steps(open_backend(export_dir, 2), export_dir, 2, margin=math.inf)  # always kept
    graph = split.backend.decoder_with_past
    assert isinstance(graph, RowSplitGraph) and graph.few_rows == FEW_ROWS
    graph.few, graph.many = Counting(graph.few), Counting(graph.many)
    rng = np.random.default_rng(0)
    for batch, beams in ((1, 1), (3, 1), (1, 4), (2, 4), (8, 1)):
        ids = rng.integers(3, 250, (batch, 9))
        np.testing.assert_array_equal(split.generate(ids, max_new_tokens=6, num_beams=beams),
                                      plain.generate(ids, max_new_tokens=6, num_beams=beams))
    assert graph.few.rows and max(graph.few.rows) <= FEW_ROWS  # 1, 3 and 4 rows ran here
    assert graph.many.rows and min(graph.many.rows) > FEW_ROWS  # 8 rows (2 x 4 beams, b8 greedy) ran there


def test_the_second_session_is_kept_only_when_faster(export_dir, monkeypatch):
    backend = open_backend(export_dir, 2)
    assert with_few_row_steps(backend, export_dir, 2, margin=0.0) is backend  # never faster by a margin of 0
    assert with_few_row_steps(backend, export_dir, 1, margin=math.inf) is backend  # one thread: nothing to split
    with one_pass():  # a runtime for one pass over long inputs keeps the one session
        assert with_few_row_steps(backend, export_dir, 2, margin=math.inf) is backend
    merged = open_backend(export_dir, 2, decoders="merged")
    assert with_few_row_steps(merged, export_dir, 2, margin=math.inf) is merged  # no separate with-past session

    def unfit(*_):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")
    monkeypatch.setattr(steps, "step_times", unfit)  # a graph the made-up step does not fit: loading goes on
    assert with_few_row_steps(backend, export_dir, 2, margin=math.inf) is backend


@pytest.mark.parametrize("inflight", [False, True])
def test_the_timed_step_runs_on_the_graph(tiny_gated_dir, export_dir, tmp_path, inflight):
    if inflight:  # the in-flight layout's with-past graph also takes the decoder mask
        export_dir = tmp_path / "inflight"
        run(tiny_gated_dir, ExportConfig(inflight=True), export_dir)
    graph = OnnxGraph(export_dir / "decoder_with_past_model.onnx", 1)
    feeds = step_feeds(graph, rows=2)
    assert set(feeds) == set(graph.input_names) and ("attention_mask" in feeds) == inflight
    out = graph.run(feeds)
    assert out["logits"].shape[:2] == (2, 1)
    a, b = step_times(graph, graph, repeats=2)
    assert a > 0 and b > 0
