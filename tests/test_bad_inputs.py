"""Bad inputs, command by command: exit code 2, one line naming the problem, no traceback, nothing written.

One row per (command, bad input). The classes behind them each have one guarded place: weights
(`models.safetensors_header`), tokenizers (`models.load_tokenizer`), graph files (`runtime.sessions.load_onnx`,
`onnx_session`, `check_torchscript`), user text (`textio`), buffer sizes (`runtime.limits`), architecture overrides
(`architectures.check_overrides`) and recipes (`recipe.plan`).
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError
from t5compress.runtime.settings import GenerationSettings

runner = CliRunner()
EXPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "graphs.json")
PT_GRAPHS = ("encoder_model.pt", "decoder_model.pt", "decoder_with_past_model.pt")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _recipe(path: Path, out: Path, stages: str) -> Path:
    path.write_text(f"name: bad\nout: {out}\nstages:\n{stages}")
    return path


@pytest.fixture(scope="module")
def d(tmp_path_factory, tiny_model_dir, tiny_export) -> dict[str, Path]:
    """Every bad input of the table, built once: damaged copies of a tiny model and of its ONNX export, files."""
    from t5compress.export.stage import ExportConfig, run

    base = tmp_path_factory.mktemp("bad")
    p = {"model": tiny_model_dir, "export": tiny_export}

    def damaged(name: str, src: Path, file: str, keep: float | int | None = None) -> None:
        """A copy of `src` named `name` whose `file` is cut to `keep` (a share or a byte count), else random."""
        p[name] = _copy(src, base / name)
        target = p[name] / file
        if keep is None:
            target.write_bytes(os.urandom(3000))
        else:
            data = target.read_bytes()
            target.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])

    damaged("cut_weights", tiny_model_dir, "model.safetensors", 0.9)  # inside the tensor data
    damaged("cut_header", tiny_model_dir, "model.safetensors", 5000)  # inside the header
    damaged("garbage_weights", tiny_model_dir, "model.safetensors")
    damaged("cut_onnx", p["export"], "encoder_model.onnx", 0.5)
    damaged("cut_past", p["export"], "decoder_with_past_model.onnx", 0.99)
    p["unreadable"] = _copy(tiny_model_dir, base / "unreadable")
    p["no_tokenizer"] = _copy(tiny_model_dir, base / "no-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (p["no_tokenizer"] / f).unlink()
    p["bad_config"] = _copy(tiny_model_dir, base / "bad-config")
    (p["bad_config"] / "config.json").write_text("{not json")
    # TorchScript dirs without an export: truncated archives, and whole ones (info reads them, never runs them)
    for name, make in (("cut_pt", lambda f: f.write_bytes(b"PK\x03\x04" + os.urandom(2000))),
                       ("fake_pt", _tiny_archive)):
        p[name] = base / name
        p[name].mkdir()
        for f in EXPORT_FILES:
            shutil.copy(p["export"] / f, p[name] / f)
        for g in PT_GRAPHS:
            make(p[name] / g)

    # config.json of a t5-xxl shape (11B parameters, ~45 GB fp32) over the tiny weights: refused before loading
    from t5compress.model.architectures import architecture

    for name, src in (("xxl_model", tiny_model_dir), ("xxl_export", p["export"])):
        p[name] = _copy(src, base / name)
        config = json.loads((p[name] / "config.json").read_text())
        (p[name] / "config.json").write_text(json.dumps({**config, **architecture("t5-xxl")}))
    # 11. files that do not belong together: a decoder-with-past of another model's shape (2 heads of 16, not 4 of
    # 8) beside the other graphs; a config.json whose d_model is twice what the weights hold
    from tests.conftest import build_tiny_t5

    other = build_tiny_t5(base / "other-model", seed=3, num_heads=2, d_kv=16)
    run(other, ExportConfig(), base / "other-export")
    p["mixed"] = _copy(p["export"], base / "mixed")
    shutil.copy(base / "other-export" / "decoder_with_past_model.onnx", p["mixed"])
    p["wide_config"] = _copy(tiny_model_dir, base / "wide-config")
    config = json.loads((p["wide_config"] / "config.json").read_text())
    (p["wide_config"] / "config.json").write_text(json.dumps({**config, "d_model": 2 * config["d_model"]}))
    p["data"] = base / "train.jsonl"
    p["data"].write_text("".join(json.dumps({"source": f"s{i}", "target": f"t{i}"}) + "\n" for i in range(20)))
    p["latin1"] = base / "latin1.txt"
    p["latin1"].write_bytes("fine\ncaf\xe9 au lait\n".encode("latin-1"))
    p["escaped"] = base / "escaped.jsonl"
    p["escaped"].write_text('{"source": "caf\\udce9"}\n')  # a JSON escape that decodes to a lone surrogate
    p["huge"] = base / "huge.txt"
    p["huge"].write_text("word " * 60_000 + "\n")  # 300k byte tokens: TiBs of encoder attention
    p["garbage_yaml"] = base / "garbage.yaml"
    p["garbage_yaml"].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    return p


def _tiny_archive(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{path.stem}/data.pkl", b"not run by info")


@pytest.fixture
def unreadable(d, monkeypatch):
    """model.safetensors with no read permission; as root (which reads anything) open() answers as for a user."""
    f = d["unreadable"] / "model.safetensors"
    f.chmod(0)
    if os.geteuid() == 0:
        real = builtins.open

        def fake_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file) == f:
                raise PermissionError(13, "Permission denied", str(file))
            return real(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
    yield
    f.chmod(0o644)


DAMAGED_WEIGHTS = "model.safetensors in '{}' is damaged or not a safetensors file"
DAMAGED_ONNX = "{} in '{}' is damaged or not an ONNX file"

# (id, argv with {placeholders} filled from the fixture's paths and {out}, the text the one line must hold, stdin)
CASES = [
    # 1. weights: truncated in the tensor data, in the header, or not safetensors at all; unreadable
    ("export-cut-weights", "export {cut_weights} {out}", DAMAGED_WEIGHTS.format("{cut_weights}"), None),
    ("train-cut-weights", "train {cut_weights} {data} {out} --max-steps 1", "truncated", None),
    ("export-cut-header", "export {cut_header} {out}", DAMAGED_WEIGHTS.format("{cut_header}"), None),
    ("export-garbage-weights", "export {garbage_weights} {out}", DAMAGED_WEIGHTS.format("{garbage_weights}"), None),
    ("train-garbage-weights", "train {garbage_weights} {data} {out} --max-steps 1", "not a safetensors file", None),
    ("export-unreadable-weights", "export {unreadable} {out}", "permission denied", None),
    # 2. no tokenizer files
    ("export-no-tokenizer", "export {no_tokenizer} {out}", "has no tokenizer: looked for tokenizer.json", None),
    ("train-no-tokenizer", "train {no_tokenizer} {data} {out} --max-steps 1", "looked for tokenizer.json", None),
    # 3. truncated graphs, wherever an export is loaded
    ("quantize-cut-onnx", "quantize {cut_onnx} {out} --dynamic",
     DAMAGED_ONNX.format("encoder_model.onnx", "{cut_onnx}"), None),
    ("quantize-cut-past", "quantize {cut_past} {out} --dynamic", "decoder_with_past_model.onnx in", None),
    ("generate-cut-onnx", "generate {cut_onnx} hello", DAMAGED_ONNX.format("encoder_model.onnx", "{cut_onnx}"), None),
    ("bench-cut-onnx", "bench {cut_onnx} -o {out}", "encoder_model.onnx in", None),
    ("generate-cut-pt", "generate {cut_pt} hello", "encoder_model.pt in '{cut_pt}' is damaged or not a TorchScript",
     None),
    # 4. text that is not UTF-8: a file, stdin, an argument (argv arrives surrogate-escaped)
    ("generate-latin1-file", "generate {export} --input {latin1}", "latin1.txt:2: not UTF-8 text (byte 0xe9 at byte "
     "offset 8)", None),
    ("generate-latin1-stdin", "generate {export} -", "<stdin>:1: not UTF-8 text (byte 0xe9 at byte offset 3)",
     b"caf\xe9\n"),
    ("generate-latin1-argument", "generate {export} caf\udce9", "argument 1: not UTF-8 text (byte 0xe9", None),
    ("generate-surrogate-escape", "generate {export} --input {escaped}", "escaped.jsonl:1: field 'source': not text",
     None),
    # 5. sizes checked before anything is allocated; contradictory lengths
    ("generate-huge-input", "generate {export} --max-input-tokens 0 --input {huge}", "input tokens fit: set "
     "max_input_tokens", None),
    ("generate-huge-output", "generate {export} hello --max-new-tokens 1000000000000", "max_new_tokens: "
     "1,000,000,000,000 new tokens (batch 1, 1 beam) need about", None),
    ("export-larger-than-the-machine", "export {xxl_model} {out}", "(11.27B parameters) needs about", None),
    ("quantize-larger-than-the-machine", "quantize {xxl_export} {out} --dynamic", "GB to quantize; this machine has",
     None),
    ("train-larger-than-the-machine", "train {xxl_model} {data} {out} --max-steps 1", "GB to train; this machine has",
     None),
    ("train-batches-larger-than-the-machine", "train {model} {data} {out} --batch-size 4096 --max-source-length "
     "65536", "at batch 4096 of 65536 -> 128 tokens: lower --batch-size", None),
    ("qat-larger-than-the-machine", "qat {xxl_model} {data} {out} --max-steps 1", "GB to qat; this machine has", None),
    ("prune-larger-than-the-machine", "prune {xxl_model} {out} --heads 0.5 --calib-data {data}",
     "GB to prune; this machine has", None),
    ("recover-larger-than-the-machine", "recover {xxl_model} {out} --data {data} --steps 1",
     "GB to recover; this machine has", None),
    ("generate-min-above-max", "generate {export} hello --min-new-tokens 10 --max-new-tokens 2",
     "min_new_tokens: 10 is more than max_new_tokens (2)", None),
    # 6. architecture overrides
    ("create-override-not-a-number", "create t5-efficient-tiny {out} --tokenizer byte -o d_model=abc",
     "overrides: d_model must be a positive integer, got 'abc'", None),
    ("create-override-negative", "create t5-efficient-tiny {out} --tokenizer byte -o num_heads=-2",
     "overrides: num_heads must be a positive integer, got -2", None),
    # 7. a recipe that is binary garbage
    ("run-garbage-recipe", "run {garbage_yaml} --out {out}", "garbage.yaml: not UTF-8 text", None),
    # 8. info on damaged dirs
    ("info-cut-weights", "info {cut_weights}", DAMAGED_WEIGHTS.format("{cut_weights}"), None),
    ("info-garbage-weights", "info {garbage_weights}", "not a safetensors file", None),
    ("info-cut-onnx", "info {cut_onnx}", DAMAGED_ONNX.format("encoder_model.onnx", "{cut_onnx}"), None),
    ("info-cut-past", "info {cut_past}", DAMAGED_ONNX.format("decoder_with_past_model.onnx", "{cut_past}"), None),
    ("info-cut-pt", "info {cut_pt}", "not a TorchScript file", None),
    ("info-bad-config", "info {bad_config}", "config.json in '{bad_config}' is damaged", None),
    # 11. files that do not belong together, wherever an export or a model dir is read
    ("triton-cut-past", "triton {cut_past} {out}", DAMAGED_ONNX.format("decoder_with_past_model.onnx", "{cut_past}"),
     None),
    *((f"{cmd.split()[0]}-mixed-graphs", cmd, "the files of '{mixed}' do not belong together: self-attention heads "
       "of decoder layer 0: 2 in decoder_with_past_model.onnx (past_key_values.0.decoder.key), 4 in config.json", None)
      for cmd in ("triton {mixed} {out}", "generate {mixed} hello", "bench {mixed} -o {out}", "info {mixed}",
                  "quantize {mixed} {out} --dynamic")),
    *((f"{cmd.split()[0]}-config-not-the-weights", cmd, "config.json in '{wide_config}' does not match its weights: "
       "d_model: 64 in config.json, 32 in the weights", None)
      for cmd in ("info {wide_config}", "export {wide_config} {out}",
                  "train {wide_config} {data} {out} --max-steps 1")),
]


@pytest.mark.parametrize("name, argv, needle, stdin", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(name, argv, needle, stdin, d, tmp_path, request):
    if "unreadable" in name:
        request.getfixturevalue("unreadable")
    out = tmp_path / "out"
    values = {k: str(v) for k, v in d.items()} | {"out": str(out)}
    result = runner.invoke(app, [a.format(**values) for a in argv.split()], input=stdin)
    _assert_one_line(result, needle.format(**values))
    assert not any(p.name.lstrip(".").startswith("out") for p in tmp_path.iterdir()), list(tmp_path.iterdir())


RECIPES = [
    ("missing-data", "  model:\n    stage: load\n    model: {model}\n  tuned:\n    stage: train\n"
                     "    train_data: {missing}\n    max_steps: 1\n", "tuned.train_data: '{missing}' does not exist"),
    ("missing-data-stage-file", "  data:\n    train: {missing}\n", "data.train: '{missing}' does not exist"),
    ("reserved-stage-id", "  recipe.json:\n    stage: load\n    model: {model}\n",
     "stages.recipe.json: 'recipe.json' is the file the runner keeps in OUT"),
    ("override-in-recipe", "  new:\n    stage: create\n    tokenizer: byte\n    overrides: {{d_model: abc}}\n",
     "new.overrides: d_model must be a positive integer"),
]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("name, stages, needle", RECIPES, ids=[r[0] for r in RECIPES])
def test_bad_recipe_is_refused_at_validation(name, stages, needle, dry_run, d, tmp_path):
    """9. A recipe naming a missing data file, or a stage id that is OUT/recipe.json, fails before anything runs."""
    out = tmp_path / "out"
    values = {"model": d["model"], "missing": tmp_path / "nope.jsonl"}
    path = _recipe(tmp_path / "bad.yaml", out, stages.format(**values))
    result = runner.invoke(app, ["run", str(path), *(["--dry-run"] if dry_run else [])])
    _assert_one_line(result, needle.format(**values))
    assert not out.exists()


def test_min_new_tokens_above_max_is_refused():
    with pytest.raises(ConfigError, match="min_new_tokens: 10 is more than max_new_tokens"):
        GenerationSettings(min_new_tokens=10, max_new_tokens=2)
    assert GenerationSettings(min_new_tokens=2, max_new_tokens=2).min_length == 3  # equal: forced length, allowed


def test_info_on_a_torchscript_dir_warns_that_loading_runs_its_code(d):
    """10. torch.jit.load runs what a .pt holds: info says so in one warning line (and in --json's warnings)."""
    result = runner.invoke(app, ["info", str(d["fake_pt"])])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "torch.jit.load runs the code" in warnings[0]
    data = json.loads(runner.invoke(app, ["info", str(d["fake_pt"]), "--json"]).stdout)
    assert data["kind"] == "torchscript export" and "torch.jit.load" in data["warnings"][0]
    assert json.loads(runner.invoke(app, ["info", str(d["export"]), "--json"]).stdout)["warnings"] == []


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.load` is deprecated:DeprecationWarning")
def test_generate_on_a_torchscript_dir_warns_that_loading_runs_its_code(tiny_model_dir, tmp_path):
    """10. generate on a TorchScript export: one warning line, then the output."""
    from t5compress.export.stage import ExportConfig, run

    run(tiny_model_dir, ExportConfig(format="torchscript"), tmp_path / "ts")
    result = runner.invoke(app, ["generate", str(tmp_path / "ts"), "hello", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning:") and "torch.jit.load runs the code" in warnings[0]
    assert len(result.stdout.splitlines()) == 1


def _assert_one_line(result, needle: str) -> None:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and needle in lines[0], (needle, lines[0])


def test_gptq_gram_counts_in_what_quantize_needs(tmp_path):
    """GPTQ's X^T X of flan-t5-large (2.3 GiB by their shapes; its static int8 peaked at 8.5 GiB, dynamic at 7.3) is
    counted: a machine with room for calibrating but not for the Grams refuses it, one with room for both does not."""
    from t5compress.errors import ModelError
    from t5compress.model.architectures import architecture
    from t5compress.runtime.limits import FLOAT, STAGE_MEMORY, check_stage_fits, gram_bytes, parameters

    config = {"vocab_size": 32128, **architecture("flan-t5-large")}
    assert 2.3e9 < gram_bytes(config) < 2.6e9  # 24 encoder + 24 decoder blocks of d_in^2 float32 matrices
    (tmp_path / "config.json").write_text(json.dumps(config))
    base, factor = STAGE_MEMORY["quantize"]
    calibrating = base + factor * FLOAT * parameters(config)
    check_stage_fits("quantize", tmp_path / "config.json", "m", available=int(calibrating) + 2**30)
    with pytest.raises(ModelError, match=r"needs about 1[34] GB to quantize"):
        check_stage_fits("quantize", tmp_path / "config.json", "m", available=int(calibrating) + 2**30,
                         extra=gram_bytes)
    check_stage_fits("quantize", tmp_path / "config.json", "m", available=int(calibrating + gram_bytes(config)) + 1,
                     extra=gram_bytes)
