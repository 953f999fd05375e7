"""`t5compress bench` on tiny real models: outputs, consistent numbers, forced lengths, peers, the edge profile, and
bad inputs (one line, non-zero exit, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from t5compress.bench.plots import pareto_front
from t5compress.cli import app
from t5compress.cpu import cpu_features

runner = CliRunner()
GRID = ["--batch-sizes", "1,2", "--beams", "1,2", "--input-tokens", "8", "--output-tokens", "8", "--repeats", "3"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_variants(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny model, its ONNX export and that export's dynamic int8."""
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize

    root = tmp_path_factory.mktemp("bench-variants")
    export(tiny_model_dir, ExportConfig(), root / "onnx")
    quantize(root / "onnx", QuantizeConfig(mode="dynamic", min_agreement=0.0), root / "int8", progress=False)
    return {"pt": tiny_model_dir, "onnx": root / "onnx", "int8": root / "int8"}


@pytest.fixture(scope="module")
def bench_run(tiny_variants, demo_jsonl, tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench") / "out"
    args = ["bench", *(f"{k}={v}" for k, v in tiny_variants.items()), "--out", str(out), "--data", str(demo_jsonl),
            "--eval-max", "16", "--max-new-tokens", "16", *GRID]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "bench.json").read_text()), result.output


def _entries(report: dict) -> dict[str, dict]:
    return {e["name"]: e for e in report["entries"]}


def _bad(args: list[str], needle: str, out: Path) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    lines = [x for x in result.output.strip().splitlines() if x.strip()]
    assert len(lines) <= 2 and needle in result.output, result.output  # one message (rich may wrap it once)
    assert not out.exists() or not (out / "bench.json").exists()


def test_bench_writes_json_markdown_plots_and_prints_the_table(bench_run):
    out, r, printed = bench_run
    for f in ("bench.json", "report.md"):
        assert (out / f).stat().st_size > 0
    for f in ("pareto.png", "sizes.png", "latency_vs_batch.png"):
        assert (out / f).read_bytes()[:8] == PNG, f
        assert (out / f).stat().st_size > 5000  # a drawn figure, not an empty canvas
    assert r["plots"] == ["pareto.png", "sizes.png", "latency_vs_batch.png"]
    assert [e["name"] for e in r["entries"]] == ["pt", "onnx", "int8"]
    assert {e["kind"] for e in r["entries"]} == {"pytorch", "onnx"}
    assert _entries(r)["int8"]["precision"] == "int8" and "dynamic" in _entries(r)["int8"]["label"]
    for name in ("pt", "onnx", "int8"):
        assert name in printed
    md = (out / "report.md").read_text()
    for section in ("## Variants", "## Latency, 1 thread", "## Goals", "![pareto.png](pareto.png)"):
        assert section in md
    assert len(r["goals"]["cells"]) == 4  # 1 thread x 2 batch sizes x 2 beam widths
    assert not list(out.glob("*.npz")) and not list(out.glob("logs/*.json"))  # no scratch left behind


def test_percentiles_ordered_and_every_output_exactly_the_forced_length(bench_run):
    _, r, _ = bench_run
    for e in r["entries"]:
        assert len(e["cells"]) == 4
        for c in e["cells"]:
            assert 0 < c["p50_ms"] <= c["p90_ms"] <= c["p99_ms"], (e["name"], c)
            assert c["new_tokens_min"] == c["new_tokens_max"] == 8 and not c["short"], (e["name"], c)
            assert c["tokens_per_s"] == pytest.approx(c["batch"] * 8 / (c["p50_ms"] / 1000), rel=0.01)
            assert c["ttft_ms"] > 0


def test_sizes_are_exactly_the_files_each_engine_loads(bench_run, tiny_variants):
    _, r, _ = bench_run
    e = _entries(r)
    assert e["pt"]["files"] == ["model.safetensors"]
    assert e["onnx"]["files"] == ["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"]
    for name, entry in e.items():
        assert entry["size_bytes"] == sum((tiny_variants[name] / f).stat().st_size for f in entry["files"])
    assert e["int8"]["size_bytes"] < e["onnx"]["size_bytes"]
    assert r["goals"]["size"]["int8"]["int8"]["ratio"] == round(e["int8"]["size_bytes"] / e["onnx"]["size_bytes"], 3)


def test_accuracy_agreement_memory_and_cold_start(bench_run):
    _, r, _ = bench_run
    e = _entries(r)
    for x in e.values():
        acc = x["accuracy"]
        assert acc["examples"] == 16 and acc["agreement_with"] == "pt"
        assert all(0 <= acc[k] <= 100 for k in ("exact_match", "rougeL", "bleu"))
        assert x["cold_start_s"] > 0 and x["peak_rss_mb"] >= x["rss_after_load_mb"] > 0
    assert e["pt"]["accuracy"]["agreement"] == 1.0
    # The export is parity-checked against PyTorch: greedy outputs may differ only on a near tie (at most 1 of 16).
    assert e["onnx"]["accuracy"]["agreement"] >= 15 / 16
    # Each variant runs in its own process: the ONNX runtime never imports torch, so its peak memory is its own and
    # well below the PyTorch worker's (a shared or inherited measurement would make them equal).
    assert e["onnx"]["peak_rss_mb"] < e["pt"]["peak_rss_mb"] - 50
    # No peers in this run: the goals say so instead of claiming anything.
    for c in r["goals"]["cells"]:
        assert c["goals"]["int8"] == {**c["goals"]["int8"], "status": "not measured", "why": "no int8 peer (--peers)"}
        assert c["goals"]["pruned+int8"]["why"] == "no pruned+int8 variant of ours; no int8 peer (--peers)"


def test_a_variant_that_crashes_becomes_an_error_entry(tiny_variants, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_variants["pt"], broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", f"onnx={tiny_variants['onnx']}", f"broken={broken}", "--out", str(out),
                                 "--batch-sizes", "1", "--beams", "1", "--input-tokens", "8", "--output-tokens", "4",
                                 "--repeats", "1", "--no-plots"])
    assert result.exit_code == 0, result.output
    e = _entries(json.loads((out / "bench.json").read_text()))
    assert "error" in e["broken"] and "worker exited" in e["broken"]["error"]
    assert e["onnx"]["cells"][0]["new_tokens_min"] == 4
    assert "broken: worker exited" in (out / "report.md").read_text()


@pytest.mark.slow  # ~35 s: optimum's exporter and CTranslate2's converter run, then both are measured
def test_peers_optimum_and_ctranslate2_on_the_same_grid(tiny_variants, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", f"pt={tiny_variants['pt']}", f"int8={tiny_variants['int8']}", "--out",
                                 str(out), "--peers", "optimum-fp32,ctranslate2-int8,openvino-fp32", "--batch-sizes",
                                 "1", "--beams", "1,2", "--input-tokens", "8", "--output-tokens", "6", "--repeats",
                                 "2", "--eval-max", "8", "--no-plots"])
    assert result.exit_code == 0, result.output
    r = json.loads((out / "bench.json").read_text())
    e = _entries(r)
    for name in ("optimum-fp32", "ctranslate2-int8"):
        p = e[name]
        assert p["role"] == "peer" and (out / "peers" / name).is_dir()
        assert p["settings"]["threads"] == [1] and p["settings"]["beams"] == [1, 2]
        assert p["size_bytes"] == sum((out / "peers" / name / f).stat().st_size for f in p["files"]) > 0
        assert all(c["new_tokens_min"] == c["new_tokens_max"] == 6 for c in p["cells"])
    assert e["optimum-fp32"]["accuracy"]["agreement"] >= 7 / 8  # the same fp32 model through ONNX Runtime
    int8_goal = r["goals"]["cells"][0]["goals"]["int8"]
    assert int8_goal["status"] in ("hit", "missed") and int8_goal["peer"]["name"] == "ctranslate2-int8"
    assert int8_goal["speedup"] == round(int8_goal["peer"]["p50_ms"] / int8_goal["ours"]["p50_ms"], 2)
    md = (out / "report.md").read_text()
    assert "## Peer settings" in md and "ctranslate2.Translator" in md
    if "openvino-fp32" not in e:  # not installed in this venv: skipped with its reason, in the report
        assert "openvino-fp32" in r["skipped"] and "openvino-fp32" in md


def test_edge_profile_reports_cpu_features_and_the_arm64_preset(tiny_variants, tmp_path):
    out = tmp_path / "edge"
    result = runner.invoke(app, ["bench", f"onnx={tiny_variants['onnx']}", f"int8={tiny_variants['int8']}", "--edge",
                                 "--out", str(out), "--batch-sizes", "1", "--beams", "1", "--input-tokens", "8",
                                 "--output-tokens", "4", "--repeats", "1", "--no-plots"])
    assert result.exit_code == 0, result.output
    r = json.loads((out / "bench.json").read_text())
    assert r["settings"]["threads"] == [1, 2]
    assert [e["name"] for e in r["entries"]] == ["int8", "onnx"]  # int8 first; agreement still against 'onnx'
    assert r["entries"][0]["accuracy"]["agreement_with"] == "onnx"
    cpu = r["edge"]["cpu"]
    flags = open("/proc/cpuinfo").read().split()
    if cpu["arch"] == "x86_64":
        assert set(cpu) >= {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx"}
        assert cpu["avx2"] == ("avx2" in flags)
    md = (out / "report.md").read_text()
    assert "## Edge profile" in md and "U8S8" in md and "asimddp" in md


def test_variant_kinds_lineage_and_files(tiny_model_dir, tiny_variants, tmp_path):
    from t5compress.bench.variants import resolve
    from t5compress.export import ExportConfig
    from t5compress.export import run as export

    export(tiny_model_dir, ExportConfig(decoders="merged"), tmp_path / "merged")
    v = resolve(f"m={tmp_path / 'merged'}")
    assert (v.kind, v.precision, v.files) == ("onnx", "fp32", ["encoder_model.onnx", "decoder_model_merged.onnx"])
    assert v.label == "ONNX merged fp32" and v.size_bytes == sum((tmp_path / "merged" / f).stat().st_size
                                                                 for f in v.files)
    v = resolve(str(tiny_variants["int8"]))
    assert (v.precision, v.label, v.lineage[:2]) == ("int8", "ONNX int8 dynamic", ["quantize", "export"])
    assert resolve(str(tiny_model_dir)).owner == "baseline"


@pytest.mark.slow  # ~35 s on a loaded 2-core machine: a TorchScript export, a prune and a second export
def test_torchscript_and_pruned_variants(tiny_model_dir, demo_jsonl, tmp_path):
    from t5compress.bench.variants import resolve
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.prune.stage import PruneConfig
    from t5compress.prune.stage import run as prune

    export(tiny_model_dir, ExportConfig(format="torchscript"), tmp_path / "ts")
    v = resolve(str(tmp_path / "ts"))
    assert (v.name, v.kind, v.owner) == ("ts", "torchscript", "ours") and len(v.files) == 3
    prune(tiny_model_dir, PruneConfig(calib_data=str(demo_jsonl), heads=0.5, ffn=0.5, criterion="magnitude",
                                      calib_examples=8, eval_max_examples=2, latency_examples=0),
          tmp_path / "pruned", progress=False)
    export(tmp_path / "pruned", ExportConfig(), tmp_path / "pruned-onnx")
    v = resolve(str(tmp_path / "pruned-onnx"))
    assert v.pruned and v.lineage[:2] == ["export", "prune"] and v.label == "ONNX fp32 (pruned)"


def test_cpu_features_of_an_arm64_board():
    info = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 asimddp i8mm\nCPU part\t: 0xd0b\n"
    f = cpu_features(info, machine="aarch64")
    assert f["arch"] == "arm64" and f["neon"] and f["dotprod"] and f["i8mm"]
    f = cpu_features("Features\t: fp asimd evtstrm\n", machine="aarch64")
    assert f["neon"] and not f["dotprod"] and not f["i8mm"]


def test_pareto_front():
    points = [("fast-bad", 1.0, 50.0), ("slow-good", 5.0, 90.0), ("dominated", 6.0, 80.0), ("mid", 2.0, 70.0)]
    assert pareto_front(points) == ["fast-bad", "slow-good", "mid"]


def test_bad_inputs_get_one_line_and_nothing_written(tiny_variants, tmp_path):
    out = tmp_path / "out"
    _bad(["bench", str(tmp_path / "nope"), "--out", str(out)], "does not exist", out)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    _bad(["bench", str(junk), "--out", str(out)], "holds no model bench can run", out)
    _bad(["bench", str(tiny_variants["onnx"]), "--out", str(out), "--peers", "ctranslate2-int8"],
         "no variant is one", out)
    _bad(["bench", str(tiny_variants["onnx"]), "--out", str(out), "--peers", "tensorrt"], "unknown peer", out)
    _bad(["bench", str(tiny_variants["pt"]), f"ctranslate2-int8={tiny_variants['int8']}", "--out", str(out),
          "--peers", "ctranslate2-int8"], "also a peer's name", out)
    _bad(["bench", str(tiny_variants["onnx"]), "--out", str(out), "--data", str(tmp_path / "none.jsonl")],
         "does not exist", out)
    out.mkdir()
    _bad(["bench", str(tiny_variants["onnx"]), "--out", str(out)], "already exists", out)
    assert list(out.iterdir()) == []
    assert not list(tmp_path.glob(".out.*"))  # no staged leftovers


@pytest.mark.slow
def test_a_triton_url_is_measured_like_the_export_it_serves(tiny_variants, demo_jsonl, tmp_path):
    """A real server (the `--portable` repository of the tiny export): the same forced lengths as every engine, and
    the served outputs are the export's own (the same runtime answers behind the server)."""
    from t5compress.bench import BenchConfig, run
    from t5compress.triton import TritonConfig
    from t5compress.triton import run as package
    from t5compress.triton.server import Ports, find_server, start

    package(tiny_variants["onnx"], TritonConfig(name="t5", portable=True, max_batch_size=8, max_beams=4),
            tmp_path / "repo")
    server = start(find_server(), tmp_path / "repo", Ports.free(), log_path=tmp_path / "server.log")
    try:
        cfg = BenchConfig(data=str(demo_jsonl), eval_max=16, max_new_tokens=16, batch_sizes=(1, 2), beams=(1, 2),
                          input_tokens=8, output_tokens=8, repeats=3)
        r = run([f"onnx={tiny_variants['onnx']}", f"served=http://{server.http_url}/t5"], cfg, tmp_path / "out",
                progress=False)
    finally:
        assert server.stop() == 0
    served = _entries(r)["served"]
    assert "error" not in served, served.get("error")
    assert served["kind"] == "triton" and served["size_bytes"] is None and served["path"].endswith("/t5")
    assert len(served["cells"]) == 4
    for c in served["cells"]:
        assert (c["new_tokens_min"], c["new_tokens_max"], c["short"]) == (8, 8, False), c
        assert c["p50_ms"] <= c["p90_ms"] <= c["p99_ms"]
    assert served["accuracy"]["agreement"] == 1.0  # the served model is the export
    assert (tmp_path / "out" / "sizes.png").is_file() and "served" in (tmp_path / "out" / "report.md").read_text()
