"""The stage protocol, read from the registry: one `run` shape, frozen configs with help on every field, the
directory kinds a stage reads and writes, and the recipe and the CLI running stages through the registry."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
from typer.testing import CliRunner

from t5compress import kinds
from t5compress.cli import app
from t5compress.errors import ConfigError
from t5compress.stages import STAGES, stage

KIND_NAMES = {k.name for k in kinds.KINDS}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_runs_with_one_signature(name):
    params = inspect.signature(STAGES[name].runner()).parameters
    first = list(params)[:3]
    assert first == ["src", "cfg", "out"], first
    for keyword, default in (("force", False), ("progress", True)):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY and params[keyword].default is default


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_config_is_frozen_and_every_field_says_what_it_is(name):
    cls = STAGES[name].config_class()
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_what_a_stage_reads_and_writes_is_a_known_kind(name):
    spec = STAGES[name]
    assert spec.reads in KIND_NAMES | {"architecture", "corpus", "variants", "nothing"}
    assert spec.writes is None or spec.writes in KIND_NAMES


def test_an_unknown_stage_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown stage 'trian'; choose one of: bench, create"):
        stage("trian")


def test_the_recipe_runs_every_registered_stage_through_the_registry():
    from t5compress.recipe import stages as recipe_stages

    assert set(recipe_stages.KINDS) == {n for n, s in STAGES.items() if s.chain} >= {
        "data", "create", "load", "pretrain", "train", "qat", "prune", "export", "quantize", "triton", "bench"}
    assert all(k.spec is STAGES[n] for n, k in recipe_stages.KINDS.items())  # no list of its own: the registry's
    assert not [n for n in dir(recipe_stages) if n.startswith("_run_")]


def test_every_report_is_told_by_its_stage_and_the_chain_is_read_off_the_registry():
    from t5compress import describe
    from t5compress.recipe.plan import CHAIN

    assert CHAIN == "data → create | load | pretrain → train | qat | prune → export → quantize → triton → bench"
    assert all(callable(getattr(describe, s.describer)) for s in STAGES.values() if s.describer)
    assert {n for n, s in STAGES.items() if not s.describer} == {"serve", "demo"}  # no report to tell
    assert "block-wise" in STAGES["quantize"].help
    assert STAGES["train"].describe({"eval": {"exact_match": 50.0, "step": 4}, "train": {"steps": 4, "seconds": 1}}) \
        == [("eval", "exact_match 50.0 (step 4)"), ("trained", "4 steps in 1 s")]


def test_kinds_tell_each_directory_apart(tiny_model_dir, tiny_export, tmp_path):
    assert kinds.kind_of(tiny_model_dir).name == "model"
    assert kinds.kind_of(tiny_export).name == "onnx-export"
    assert kinds.kind_of(tmp_path / "missing") is None and kinds.kind_of("google/t5-small") is None
    (tmp_path / "qat").mkdir()
    for f in tiny_model_dir.iterdir():
        (tmp_path / "qat" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "qat" / kinds.SCALES_JSON).write_text("{}")
    assert kinds.kind_of(tmp_path / "qat").name == "qat-model"
    assert kinds.export_hook(tmp_path / "qat").__name__ == "prepare_export"  # found without export importing qat
    with pytest.raises(Exception, match="is a onnx export; expected model"):
        kinds.require_kind(tiny_export, "model")


def test_bench_writes_the_stage_files_like_every_stage(tiny_model_dir, tmp_path):
    from t5compress.bench import BenchConfig
    from t5compress.bench.stage import run

    out = tmp_path / "b"
    run([f"m={tiny_model_dir}"], BenchConfig(batch_sizes=(1,), beams=(1,), input_tokens=4, output_tokens=2,
                                            repeats=1, plots=False, eval_max=2), out, progress=False)
    meta = json.loads((out / "t5compress.json").read_text())
    report = json.loads((out / "report.json").read_text())
    assert meta["stage"] == "bench" and meta["config"]["variants"] == [f"m={tiny_model_dir}"]
    assert report["stage"] == "bench" and report["entries"] == json.loads((out / "bench.json").read_text())["entries"]


def test_info_says_which_stage_made_a_directory_and_what_it_does(tiny_model_dir, tmp_path):
    out = tmp_path / "onnx"
    assert CliRunner().invoke(app, ["export", str(tiny_model_dir), str(out)]).exit_code == 0
    shown = CliRunner().invoke(app, ["info", str(out), "--json"])
    lineage = json.loads(shown.output)["lineage"]
    assert lineage["stage"] == "export" and lineage["what"] == STAGES["export"].help


def test_serve_config_refuses_a_bad_port():
    cls = stage("serve").config_class()
    with pytest.raises(ConfigError, match="http_port: must be a port number"):
        cls(http_port=0)
