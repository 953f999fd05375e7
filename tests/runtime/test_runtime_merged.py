"""`--decoders merged`: an export dir with the encoder and the merged decoder alone, run by the runtime and the CLI.

The merged decoder's first step runs with zero-length past tensors and `use_cache_branch=False`, later steps with
True; its tokens must be those of the separate decoders and of transformers, greedy and beam, on real exports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError, ModelError
from t5compress.export import ExportConfig, run
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, WEIGHTS_FILE
from t5compress.onnxstore import weight_bytes
from t5compress.runtime import detect_format, load_runtime
from tests.runtime.test_runtime import BEAM, GREEDY, MODELS, assert_same, build_model, inputs, reference

runner = CliRunner()
NAMES = ("relu-tied", "gated-untied")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, tuple[Path, Path | None, Path]]:
    """name -> (model dir, export with both decoder layouts or None, export with the merged decoder alone)."""
    root = tmp_path_factory.mktemp("merged")
    out = {}
    for name in NAMES:
        model = build_model(root / name, **MODELS[name])
        both, merged = (root / f"{name}-both" if name == "relu-tied" else None), root / f"{name}-merged"
        if both:
            run(model, ExportConfig(decoders="both", atol=1e-2), both)  # large init: see test_runtime.export_with
        external = 0 if name == "gated-untied" else ExportConfig().external_data_threshold  # weights in .onnx_data
        run(model, ExportConfig(decoders="merged", atol=1e-2, external_data_threshold=external), merged)
        out[name] = (model, both, merged)
    return out


def _onnx_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix == ".onnx")


def test_merged_only_dir_holds_encoder_and_merged_decoder_and_is_smaller(dirs):
    _, both, merged = dirs["relu-tied"]
    assert _onnx_files(merged) == [f"{DECODER_MERGED}.onnx", f"{ENCODER}.onnx"]
    assert _onnx_files(both) == sorted(f"{g}.onnx" for g in (ENCODER, DECODER, DECODER_WITH_PAST, DECODER_MERGED))
    assert list(json.loads((merged / "graphs.json").read_text())) == [ENCODER, DECODER_MERGED]
    report = json.loads((merged / "report.json").read_text())
    assert report["decoders"] == "merged" and report["graphs"] == [ENCODER, DECODER_MERGED]
    assert report["parity"]["generation"]["identical"] and report["parity"]["generation_by_decoders"] == {
        "merged": True}
    both_report = json.loads((both / "report.json").read_text())
    assert both_report["parity"]["generation_by_decoders"] == {"separate": True, "merged": True}
    size = {f: weight_bytes(both / f) for f in _onnx_files(both)}  # wherever the weights are stored (onnxstore)
    separate = size[f"{DECODER}.onnx"] + size[f"{DECODER_WITH_PAST}.onnx"]
    # Weights the two decoders share are stored once: well under the two side by side.
    assert weight_bytes(merged / f"{DECODER_MERGED}.onnx") < 0.8 * separate
    assert detect_format(merged) == "onnx"


def test_merged_decoder_generates_the_tokens_of_the_separate_ones_and_transformers(dirs):
    model, both, merged = dirs["relu-tied"]
    only = load_runtime(merged, threads=1)
    separate = load_runtime(both, threads=1, decoders="separate")
    assert type(only.backend.decoder).__name__ == "MergedStep"
    assert type(separate.backend.decoder).__name__ == "FirstStep"  # the first step on the with-past graph
    ids, mask = inputs(5, seed=3)
    for gen in [*GREEDY, *BEAM]:
        got = only.generate(ids, mask, **gen)
        assert_same(got, reference(model, ids, mask, **gen))
        np.testing.assert_array_equal(got, separate.generate(ids, mask, **gen))
    both_merged = load_runtime(both, threads=1, decoders="merged")
    assert_same(both_merged.generate(ids, mask, num_beams=4), only.generate(ids, mask, num_beams=4))


def test_optimum_runs_the_merged_only_dir_too(dirs):
    """optimum picks decoder_model_merged.onnx when it is the only decoder (its merged path needs d_kv * heads ==
    d_model, true here)."""
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    model, _, merged = dirs["relu-tied"]
    ids, mask = inputs(3, seed=6)
    ort_model = ORTModelForSeq2SeqLM.from_pretrained(merged)
    got = ort_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             num_beams=1, max_new_tokens=10).numpy()
    assert_same(got, reference(model, ids, mask, num_beams=1, max_new_tokens=10))


def test_merged_only_gated_untied_matches_transformers(dirs):
    """T5 v1.1 / Flan shape (gated-gelu, untied), weights in external data: the merged decoder alone."""
    model, _, merged = dirs["gated-untied"]
    graph_files = sorted(p.name for p in merged.iterdir() if ".onnx" in p.name)
    assert graph_files == [f"{DECODER_MERGED}.onnx", f"{ENCODER}.onnx", WEIGHTS_FILE]  # one weights file
    report = json.loads((merged / "report.json").read_text())
    assert report["parity"]["generation_by_decoders"] == {"merged": True}
    only = load_runtime(merged, threads=1)
    ids, mask = inputs(5, seed=4)
    for gen in (GREEDY[0], GREEDY[1], BEAM[0], BEAM[4]):
        assert_same(only.generate(ids, mask, **gen), reference(model, ids, mask, **gen))


def test_incomplete_or_unknown_layouts_are_one_line(dirs, tmp_path):
    _, both, merged = dirs["relu-tied"]
    with pytest.raises(ModelError, match="has no separate decoder graphs: needs .*decoder_model.onnx"):
        load_runtime(merged, decoders="separate")
    with pytest.raises(ModelError, match="unknown decoders 'fused'"):
        load_runtime(both, decoders="fused")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(merged / f"{DECODER_MERGED}.onnx", lonely)
    with pytest.raises(ModelError, match=r"incomplete export directory: missing encoder_model\.onnx$"):
        detect_format(lonely)
    with pytest.raises(ConfigError, match="^decoders: choose one of separate, merged, both"):
        ExportConfig(decoders="fused")
    with pytest.raises(ConfigError, match="^format: .*ONNX exports only"):
        ExportConfig(format="torchscript", decoders="merged")


def test_cli_export_merged_then_generate_and_info(dirs, tmp_path):
    model, _, merged = dirs["relu-tied"]
    out = tmp_path / "cli-merged"
    result = runner.invoke(app, ["export", str(model), str(out), "--decoders", "merged", "--atol", "1e-2"])
    assert result.exit_code == 0, result.output
    assert f"{ENCODER}, {DECODER_MERGED}" in result.output and _onnx_files(out) == _onnx_files(merged)
    texts = ["hello there", "a longer input text"]
    gen = runner.invoke(app, ["generate", str(out), *texts, "--num-beams", "3"])
    assert gen.exit_code == 0, gen.output
    rt = load_runtime(merged)
    assert gen.output.splitlines() == [" ".join(t.splitlines()) for t in rt.generate_text(texts, num_beams=3)]
    info = json.loads(runner.invoke(app, ["info", str(out), "--json"]).output)
    assert info["kind"] == "onnx export" and info["report"]["decoders"] == "merged"
    shown = runner.invoke(app, ["info", str(out)])
    assert shown.exit_code == 0 and "greedy == generate" in shown.output
    assert "decoder_model_merged.onnx" in shown.output
    bad = runner.invoke(app, ["export", str(model), str(tmp_path / "bad"), "--decoders", "fused"])
    assert bad.exit_code != 0 and "decoders: choose one of" in bad.output and not (tmp_path / "bad").exists()
