"""Accuracy-aware static int8 (onnx-neural-compressor's autotune): the task metric kept within tolerance of fp32."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError
from t5compress.names import GRAPHS
from t5compress.quantize import QuantizeConfig
from t5compress.quantize.tune import FALLBACKS, TUNE_ORDER, candidates, fp32_nodes
from tests.quantize.test_inputs import watched_run

runner = CliRunner()


def _data(skilled: Path, name: str) -> str:
    return str(skilled / "data" / f"{name}.jsonl")


@pytest.mark.slow
def test_tuning_keeps_layers_fp32_until_the_metric_is_back(skilled, tmp_path):
    # Tolerance 0: every example fp32 gets right, int8 must get right too. Per-tensor weights lose one or two
    # examples here (measured: the encoder drops exact match 72.0 -> 71.5), so the search has to fall back.
    out = tmp_path / "tuned"
    r, events, before, after = watched_run(
        skilled / "onnx", QuantizeConfig(calib_data=_data(skilled, "train"), eval_data=_data(skilled, "eval"),
                                         samples=64, per_channel=False, tolerance=0.0), out, progress=False)
    assert events == [] and after == before  # onnx-neural-compressor wrote <graph>_augment.onnx beside the graph
    tuned = r["graphs"]["tuning"]
    fp32, int8 = r["eval"]["fp32"]["exact_match"], r["eval"]["int8"]["exact_match"]
    assert tuned["metric"] == "exact_match" and tuned["fp32"] == fp32 and tuned["int8"] == int8
    assert 50 <= fp32 < 100
    assert int8 >= fp32  # tolerance 0, end to end
    trials, whole = tuned["trials"], {}
    assert [g for g in TUNE_ORDER if any(t["graph"] == g for t in trials)] == list(TUNE_ORDER)
    for g in GRAPHS:
        mine = [t for t in trials if t["graph"] == g]
        # onnx-neural-compressor stops at the first candidate that meets the goal, and only there
        assert mine[-1]["meets_goal"] and not any(t["meets_goal"] for t in mine[:-1]), mine
        assert [t["candidate"] for t in mine] == list(range(len(mine)))
        kept = r["graphs"][g]["kept_fp32"]
        assert len(kept) == mine[-1]["kept_fp32"]
        # the nodes reported fp32 are in the written graph, with their fp32 weights; the rest is int8, unless the
        # search had to take its last candidate, the whole graph fp32 (the encoder, on an Intel Xeon with AMX, where
        # the fixture trains a little differently: a knife-edge example flips with any int8 layer of it)
        assert sorted(fp32_nodes(out / f"{g}.onnx", kept)) == sorted(kept)
        whole[g] = len(mine) == len(r["graphs"][g]["candidates"])
        int8_nodes = Counter(n.op_type for n in onnx.load(str(out / f"{g}.onnx")).graph.node)["DequantizeLinear"]
        assert (r["graphs"][g]["quantized_nodes"] > 0 and int8_nodes > 0) or (whole[g] and int8_nodes == 0), mine
    first = [t for t in trials if t["candidate"] == 0]
    if all(t["meets_goal"] for t in first):
        # All int8 already keeps the metric: on an AVX2 CPU without VNNI, with the skilled model trained at 1 thread
        # (as in the whole suite), per-tensor int8 scored 70.5-71.5 vs fp32 70.5, so the search rightly stops at
        # the first candidate of every graph and keeps nothing fp32.
        assert len(trials) == len(GRAPHS) and all(r["graphs"][g]["kept_fp32"] == [] for g in GRAPHS)
    else:
        assert any(not t["meets_goal"] for t in trials)  # the search really searched
        assert sum(len(r["graphs"][g]["kept_fp32"]) for g in GRAPHS) > 0
        # and kept part of a graph fp32, the rest int8, somewhere (the with-past step's LM head on the Xeon)
        assert any(r["graphs"][g]["kept_fp32"] and r["graphs"][g]["quantized_nodes"] for g in GRAPHS)
    assert r["size"]["ratio"] < (0.7 if any(whole.values()) else 0.5)  # the Xeon's, with its encoder fp32: 0.636


@pytest.mark.slow
def test_cli_tolerance_happy_path_and_bad_input(skilled, tmp_path):
    out = tmp_path / "cli"
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(out), "--calib-data", _data(skilled, "train"),
                              "--samples", "32", "--eval-data", _data(skilled, "eval"), "--tolerance", "0.01"])
    assert res.exit_code == 0, res.output
    assert "tuned by onnx-neural-compressor" in res.output
    r = json.loads((out / "report.json").read_text())
    tuned = r["graphs"]["tuning"]
    assert tuned["int8"] >= tuned["fp32"] * 0.99 and r["eval"]["int8"]["exact_match"] == tuned["int8"]
    res = runner.invoke(app, ["quantize", str(skilled / "onnx"), str(tmp_path / "bad"), "--calib-data",
                              _data(skilled, "train"), "--eval-data", _data(skilled, "eval"), "--tolerance", "1.5"])
    assert res.exit_code == 2 and "tolerance: must be in [0, 1)" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_bad_tolerance_is_a_one_line_config_error():
    for kw in [{"tolerance": -0.1}, {"tolerance": 1.0}, {"tolerance": 0.01, "eval_data": None},
               {"tolerance": 0.01, "mode": "dynamic", "calib_data": None}]:
        with pytest.raises(ConfigError, match="^tolerance: ") as e:
            QuantizeConfig(**{"calib_data": "c.txt", "eval_data": "e.jsonl", **kw})
        assert "\n" not in str(e.value)
    assert QuantizeConfig(calib_data="c.txt", eval_data="e.jsonl", tolerance=0.01).tolerance == 0.01


def test_candidates_grow_from_the_configured_fp32_nodes_to_all():
    nodes = ["/encoder/block.0/layer.0/SelfAttention/q/MatMul", "/encoder/block.0/layer.0/SelfAttention/o/MatMul",
             "/encoder/block.0/layer.1/DenseReluDense/wi/MatMul", "/encoder/block.0/layer.1/DenseReluDense/wo/MatMul",
             "/encoder/embed_tokens/Gather", "/encoder/Relu"]
    linear = nodes[:5]
    c = candidates(nodes, [nodes[3]], linear)
    labels = [label for label, _ in c]
    assert labels == ["as configured", "+ other op types", "+ FFN input wi", "+ attention output o",
                      "+ attention q/k/v", "+ embeddings"]
    assert c[0][1] == [nodes[3]] and c[1][1] == [nodes[3], "/encoder/Relu"]
    for (_, a), (_, b) in zip(c, c[1:], strict=False):
        assert set(a) < set(b)  # every candidate keeps strictly more fp32
    assert set(c[-1][1]) == set(nodes)
    assert {label for label, _ in FALLBACKS} >= {lab[2:] for lab in labels[2:]}


def test_environment_is_consistent_but_for_the_documented_numpy_pin():
    # onnx-neural-compressor is installed --no-deps (Makefile): its numpy<2 pin is the one violation pip may report,
    # and the path it is violated for is the one the tests above run under this numpy.
    import subprocess
    import sys

    import numpy as np

    res = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    problems = [line for line in res.stdout.splitlines() if line.strip() and "No broken requirements" not in line]
    assert all(line.startswith("onnx-neural-compressor 1.0 has requirement numpy<2") for line in problems), problems
    assert int(np.__version__.split(".")[0]) >= 2
