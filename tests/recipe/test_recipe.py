"""Recipes: validation before anything runs (through the library and the CLI), and a tiny chain run end to end,
rerun (every stage skipped) and changed (the changed stage and those after it rerun, not those before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from t5compress import recipe
from t5compress.cli import app
from t5compress.names import WEIGHTS_FILE
from t5compress.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
runner = CliRunner()


def tiny(out: Path, **changes: dict) -> dict:
    """A tiny chain: generated data, a new 2-layer T5, a few training steps, ONNX export, static int8, bench."""
    doc = {
        "name": "tiny",
        "out": str(out),
        "stages": {
            "data": {"generate": "demo", "train_examples": 120, "eval_examples": 16},
            "model-init": {"stage": "create", "arch": "t5-efficient-tiny", "vocab_size": 200,
                           "overrides": {"d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16, "num_layers": 1,
                                         "num_decoder_layers": 1}},
            "model": {"stage": "train", "max_steps": 4, "batch_size": 8, "eval_every": 0, "eval_max_examples": 8,
                      "max_source_length": 24, "max_target_length": 16, "eval_max_new_tokens": 8},
            "onnx": {"stage": "export", "max_new_tokens": 4},
            "int8": {"stage": "quantize", "samples": 8, "batch_size": 8, "max_new_tokens": 4, "min_agreement": 0.0},
            "bench": {"variants": ["onnx", "int8"], "batch_sizes": [1], "beams": [1], "input_tokens": 8,
                      "output_tokens": 4, "repeats": 2, "warmup": 0, "eval_max": 8, "max_new_tokens": 8,
                      "plots": False},
        },
    }
    for sid, settings in changes.items():
        doc["stages"][sid] = {**doc["stages"].get(sid, {}), **settings}
    return doc


def write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def error_of(tmp_path: Path, doc: dict) -> str:
    with pytest.raises(RecipeError) as e:
        recipe.load(write(tmp_path / "r.yaml", doc))
    return str(e.value)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_validates(path):
    r = recipe.load(path)
    assert r.stages[-1].kind.name == "bench" and r.out == Path("runs") / path.stem
    assert len(recipe.plan(r)) == len(r.stages)


def test_shipped_recipes_say_what_the_issue_asks():
    assert {p.stem for p in SHIPPED} >= {"quickstart", "t5-small-int8", "t5-efficient-small-el2-pruned-int8",
                                         "flan-t5-gated-wo-fp32"}
    flan = recipe.load(ROOT / "recipes" / "flan-t5-gated-wo-fp32.yaml")
    assert "wo" in flan.stage("int8").config.keep_fp32
    el2 = recipe.load(ROOT / "recipes" / "t5-efficient-small-el2-pruned-int8.yaml")
    rec = el2.stage("pruned").config.recover
    assert rec is not None and rec.train.lr == 1e-3 and not rec.lr_per_width  # a recipe's rate is taken as given
    assert [s.kind.name for s in el2.stages].count("quantize") >= 1


def test_the_embedded_quickstart_is_recipes_quickstart():
    assert (ROOT / "recipes" / "quickstart.yaml").resolve() == recipe.QUICKSTART.resolve()  # one file, not a copy
    r = recipe.load(recipe.QUICKSTART)
    assert [s.kind.name for s in r.stages][:5] == ["data", "create", "train", "export", "quantize"]
    assert not any(s.kind.name in ("load",) for s in r.stages)  # no download


def test_a_typo_is_rejected_through_the_cli_with_the_closest_key(tmp_path):
    path = write(tmp_path / "typo.yaml", tiny(tmp_path / "out", model={"max_stepz": 5}))
    res = runner.invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0, res.output  # one line
    assert "model.max_stepz: unknown key; did you mean 'max_steps'?" in res.output
    assert not (tmp_path / "out").exists()  # validated before anything runs


@pytest.mark.parametrize("change, needle", [
    ({"model": {"max_steps": -1}}, "model.max_steps: must be >= 0"),  # the config's own check
    ({"model": {"lr": "fast"}}, "model.lr: expected a number, got str 'fast'"),
    ({"model": {"metric": "acc"}}, "model.metric: choose one of"),
    ({"int8": {"mode": "static", "calib_data": None}}, "int8.calib_data: static quantization needs"),
    ({"pruned": {"stage": "prune", "input": "model", "heads": 0.5, "recover": {"max_stepz": 3}}},
     "pruned.recover.max_stepz: unknown key; did you mean 'max_steps'?"),
    ({"onnx": {"stage": "exprot"}}, "onnx: unknown stage 'exprot'; did you mean 'export'?"),
    ({"q2": {"stage": "quantize", "input": "model"}}, "q2.input: 'model' gives a model; a quantize stage reads"),
    ({"q2": {"stage": "quantize", "input": "nope"}}, "q2.input: no stage 'nope' before this one"),
    ({"data": None}, "model-init.text: a unigram tokenizer needs --text"),  # no data stage: nothing to read
    ({"data": None, "model-init": {"tokenizer": "byte"}}, "model.train_data: required (give it, or put a data stage"),
])
def test_bad_recipes_are_one_line_naming_stage_and_key(tmp_path, change, needle):
    doc = tiny(tmp_path / "out")
    for sid, settings in change.items():
        if settings is None:
            del doc["stages"][sid]
        else:
            doc["stages"][sid] = {**doc["stages"].get(sid, {}), **settings}
    msg = error_of(tmp_path, doc)
    assert needle in msg and "\n" not in msg, msg


def test_stages_out_of_order_and_missing_inputs_are_rejected(tmp_path):
    doc = tiny(tmp_path / "out")
    stages = doc["stages"]
    doc["stages"] = {k: stages[k] for k in ("data", "model-init", "onnx", "model", "int8")}
    assert "model: a train stage cannot come after 'onnx' (export)" in error_of(tmp_path, doc)
    doc["stages"] = {"data": stages["data"], "int8": stages["int8"]}
    assert "int8: a quantize stage reads an export, and no stage before it gives one" in error_of(tmp_path, doc)
    doc["stages"] = {"data": stages["data"], "model-init": stages["model-init"], "model": {"stage": "train"}}
    doc["stages"]["data2"] = {"stage": "data", "generate": "demo"}
    assert "a recipe has one data stage" in error_of(tmp_path, doc)
    assert "stages.nmae: unknown key; did you mean 'name'" not in error_of(tmp_path, {**doc, "nmae": 1})
    assert "nmae: unknown key; did you mean 'name'?" in error_of(tmp_path, {**doc, "nmae": 1})


def test_a_directory_the_recipe_did_not_write_is_not_replaced_without_force(tmp_path):
    (tmp_path / "out" / "model").mkdir(parents=True)
    (tmp_path / "out" / "model" / "mine.txt").write_text("keep me")
    res = runner.invoke(app, ["run", str(write(tmp_path / "r.yaml", tiny(tmp_path / "out")))])
    assert res.exit_code == 2 and "was not written by this recipe" in res.output and "--force" in res.output
    assert (tmp_path / "out" / "model" / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "out" / "data").exists()  # refused before the first stage ran


def test_a_failed_stage_is_redone_on_the_next_run(tmp_path):
    doc = tiny(tmp_path / "out")
    doc["stages"] = {"data": doc["stages"]["data"], "bad": {"stage": "load", "model": str(tmp_path / "empty")}}
    (tmp_path / "empty").mkdir()  # a directory, so it validates; it holds no model, so the stage fails
    path = write(tmp_path / "r.yaml", doc)
    res = runner.invoke(app, ["run", str(path)])
    assert res.exit_code == 2 and "has no config.json: not a Hugging Face model directory" in res.output
    state = json.loads((tmp_path / "out" / "recipe.json").read_text())["stages"]
    assert "fingerprint" in state["data"] and state["bad"]["unfinished"] is True
    rows = {r["id"]: r["why"] for r in recipe.plan(recipe.load(path))}
    assert rows == {"data": "done, unchanged", "bad": "not run yet"}  # its dir was never written
    (tmp_path / "out" / "bad").mkdir()  # as if an earlier, finished run had left it
    assert recipe.plan(recipe.load(path))[1]["why"] == "the last run of it did not finish"


def test_duplicate_stage_ids_are_rejected(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: x\nout: o\nstages:\n  data: {generate: demo}\n  data: {generate: demo}\n")
    with pytest.raises(RecipeError, match="line 5: key 'data' given twice"):
        recipe.load(path)


@pytest.mark.slow
def test_a_tiny_recipe_runs_then_skips_then_reruns_only_what_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    out = Path("out")
    path = write(Path("tiny.yaml"), tiny(out))
    res = runner.invoke(app, ["run", str(path)])
    assert res.exit_code == 0, res.output
    assert "ran 6, skipped 0" in res.output
    state = json.loads((out / "recipe.json").read_text())
    assert list(state["stages"]) == ["data", "model-init", "model", "onnx", "int8", "bench"]
    export = json.loads((out / "onnx" / "report.json").read_text())
    assert max(export["parity"]["max_abs_diff"].values()) < 1e-4  # the export matches PyTorch
    int8 = json.loads((out / "int8" / "report.json").read_text())
    # Each weight stored once in both dirs: on these tiny layers the int8 graphs' Q/DQ structure outweighs all the
    # weights (the int8 dir is the larger), so the weights file alone (measured 0.26x)
    assert (out / "int8" / WEIGHTS_FILE).stat().st_size < 0.5 * (out / "onnx" / WEIGHTS_FILE).stat().st_size
    assert len((out / "data" / "train.jsonl").read_text().splitlines()) == 120
    assert json.loads((out / "model" / "report.json").read_text())["train"]["steps"] == 4
    bench = json.loads((out / "bench" / "bench.json").read_text())
    sizes = {e["name"]: e["size_bytes"] for e in bench["entries"]}
    assert list(sizes) == ["onnx", "int8"]  # the bytes of the files each loads, the weights file included
    assert sizes == {"onnx": int8["size"]["fp32_bytes"], "int8": int8["size"]["int8_bytes"]}
    assert bench["sizes"]["checkpoint"]["safetensors_bytes"] == (out / "model" / "model.safetensors").stat().st_size
    assert bench["inputs"]["eval_examples"] == 8 and (out / "bench" / "report.md").is_file()

    # A rerun skips every stage (the outputs are complete and nothing changed).
    again = recipe.run(recipe.load(path), progress=False)
    assert again["ran"] == [] and len(again["skipped"]) == 6
    assert all(r["why"] == "done, unchanged" for r in again["stages"])

    # A changed training setting reruns train and what reads it, not data or create.
    write(path, tiny(out, model={"max_steps": 6}))
    rows = {r["id"]: r["why"] for r in recipe.plan(recipe.load(path))}
    assert rows == {"data": "done, unchanged", "model-init": "done, unchanged", "model": "settings changed",
                    "onnx": "input 'model' reruns", "int8": "input 'onnx' reruns", "bench": "input 'onnx' reruns"}
    dry = runner.invoke(app, ["run", str(path), "--dry-run"])
    assert dry.exit_code == 0 and "4 of 6 stages to run" in dry.output
    assert json.loads((out / "model" / "report.json").read_text())["train"]["steps"] == 4  # dry run ran nothing
    third = recipe.run(recipe.load(path), progress=False)
    assert third["ran"] == ["model", "onnx", "int8", "bench"] and third["skipped"] == ["data", "model-init"]
    assert json.loads((out / "model" / "report.json").read_text())["train"]["steps"] == 6

    # A change to one stage reruns it and what reads it only; --force would rerun everything.
    write(path, tiny(out, model={"max_steps": 6}, int8={"samples": 12}))
    assert [r["action"] for r in recipe.plan(recipe.load(path))] == ["skip"] * 4 + ["run"] * 2
    assert [r["action"] for r in recipe.plan(recipe.load(path), force=True)] == ["run"] * 6


def test_editing_a_data_file_reruns_the_stages_that_read_it(tmp_path):
    from t5compress.tasks import make_examples, write_jsonl

    train = tmp_path / "train.jsonl"
    write_jsonl(train, make_examples(60, seed=0))
    doc = {"name": "files", "out": str(tmp_path / "out"), "stages": {
        "data": {"train": str(train)},
        "model-init": {"stage": "create", "vocab_size": 120, "overrides": {
            "d_model": 16, "d_ff": 32, "num_heads": 2, "d_kv": 8, "num_layers": 1, "num_decoder_layers": 1}},
        "bytes": {"stage": "create", "tokenizer": "byte", "overrides": {
            "d_model": 16, "d_ff": 32, "num_heads": 2, "d_kv": 8, "num_layers": 1, "num_decoder_layers": 1}}}}
    path = write(tmp_path / "files.yaml", doc)
    assert recipe.run(recipe.load(path), progress=False)["ran"] == ["data", "model-init", "bytes"]
    meta = json.loads((tmp_path / "out" / "model-init" / "t5compress.json").read_text())
    assert meta["config"]["text"] == str(train)
    with open(train, "a") as f:
        f.write(json.dumps({"source": "sort words: moon apple", "target": "apple moon"}) + "\n")
    rows = {r["id"]: (r["action"], r["why"]) for r in recipe.plan(recipe.load(path))}
    # The tokenizer of model-init was trained on the file; the byte tokenizer of `bytes` reads nothing.
    assert rows == {"data": ("run", "a file it reads changed"), "model-init": ("run", "a file it reads changed"),
                    "bytes": ("skip", "done, unchanged")}


def test_qat_and_triton_stages_take_their_cli_settings(tmp_path):
    doc = tiny(tmp_path / "out")
    doc["stages"] = {k: doc["stages"][k] for k in ("data", "model-init")} | {
        "qat": {"max_steps": 10, "act_scale": "ema", "keep_wo": "yes", "max_source_length": 24},
        "qat-onnx": {"stage": "export"},
        "serve": {"stage": "triton", "input": "qat-onnx", "portable": True, "max_batch_size": 4},
        "bench": {"variants": ["qat", "qat-onnx"]},
    }
    r = recipe.load(write(tmp_path / "r.yaml", doc))
    qat = r.stage("qat").config
    assert (qat.finetune.train.max_steps, qat.quant.act_scale, qat.quant.keep_wo) == (10, "ema", "yes")
    assert qat.finetune.data.max_source_length == 24 and qat.finetune.train_data.endswith("data/train.jsonl")
    assert r.stage("qat-onnx").artifact == "int8 export"  # a QAT model exports to Q/DQ int8 graphs
    assert r.stage("serve").config.portable and r.stage("serve").deps == ("qat-onnx",)
    assert r.stage("bench").deps == ("data", "qat", "qat-onnx") and r.stage("bench").config.data.endswith("eval.jsonl")
    doc["stages"]["int8"] = {"stage": "quantize", "input": "qat-onnx"}
    assert "int8.input: 'qat-onnx' gives an int8 export; a quantize stage reads an export" in error_of(tmp_path, doc)


def test_demo_is_the_quickstart_recipe(tmp_path):
    res = runner.invoke(app, ["demo", "--out", str(tmp_path / "q"), "--max-steps", "40", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "12 of 12 stages to run" in res.output and not (tmp_path / "q").exists()
    from t5compress import demo

    r = demo.load(demo.DemoConfig(max_steps=40), tmp_path / "q")
    assert r.source == str(recipe.QUICKSTART) and r.stage("model").config.train.max_steps == 40
    assert r.stage("model").config.train.eval_every == 10
    default = demo.load(demo.DemoConfig())  # the demo's defaults are the recipe's own settings: one fingerprint
    assert recipe.plan(default) == recipe.plan(recipe.load(ROOT / "recipes" / "quickstart.yaml"))
    res = runner.invoke(app, ["run", "quickstart", "--only", "int8", "--out", str(tmp_path / "q"), "--dry-run"])
    assert res.exit_code == 0 and "5 of 5 stages to run" in res.output and "pruned" not in res.output
    res = runner.invoke(app, ["demo", "--max-steps", "0", "--dry-run"])
    assert res.exit_code == 2 and "max_steps: must be > 0" in res.output


def test_a_stage_that_has_not_landed_is_rejected_not_skipped(tmp_path):
    doc = tiny(tmp_path / "out", serve={"stage": "serve"})
    assert error_of(tmp_path, doc).endswith("serve: stage 'serve' has not landed in t5compress 0.1.0: a recipe "
                                            "cannot start a Triton server yet; run `t5compress serve OUT/<triton "
                                            "stage id>` after it")
    # pretrain (issue 8) has landed: a source of models that takes its command's settings
    doc = tiny(tmp_path / "out", base={"stage": "pretrain", "corpus": str(tmp_path / "r.yaml"), "max_steps": 5})
    doc["stages"] = {k: doc["stages"][k] for k in ("data", "base", "model")}
    write(tmp_path / "r.yaml", doc)
    r = recipe.load(tmp_path / "r.yaml")
    assert r.stage("base").config.config.train.max_steps == 5 and r.stage("model").deps == ("data", "base")
