"""fp16 exports: parity with the fp32 model at a half-precision tolerance, no overflow where fp16 `wo` overflows,
fp32 logits, half the file size, generation from them, and the one-line refusals (bf16, TorchScript, QAT dirs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError
from t5compress.export import ExportConfig, run
from t5compress.export.precision import KEEP_FP32, half_model
from t5compress.export.verify import make_batch, open_onnx
from t5compress.model.load import load_model, save_model_dir
from t5compress.model.tokenization import byte_level
from t5compress.names import DECODER, DECODER_MERGED, DECODER_WITH_PAST, ENCODER, GRAPHS
from t5compress.runtime import load_runtime
from tests.conftest import build_tiny_t5

torch.set_num_threads(1)
runner = CliRunner()
# What the tests hold a half export to, against the fp32 PyTorch model: the export's defaults (half_atol 0.01,
# half_rtol 0.02 of each tensor's largest magnitude); measured use of it on these models is ~5%.
HALF_ATOL, HALF_RTOL = 0.01, 0.02


def _weight_bytes(d: Path) -> int:
    """Bytes of the float weights (2-D initializers) in the dir's graphs (tiny models: the graph structure itself
    weighs as much as the weights, so file sizes would say little)."""
    import onnx

    total = 0
    for f in d.glob("*.onnx"):
        total += sum(len(t.raw_data) for t in onnx.load(str(f)).graph.initializer if len(t.dims) == 2)
    return total


@pytest.fixture(scope="module")
def gated_fp32_fp16(tiny_gated_dir, tmp_path_factory) -> tuple[Path, Path, dict]:
    """The Flan-shaped tiny model exported twice: fp32 and fp16 (both decoder layouts)."""
    root = tmp_path_factory.mktemp("half")
    run(tiny_gated_dir, ExportConfig(decoders="both"), root / "fp32")
    report = run(tiny_gated_dir, ExportConfig(dtype="fp16", decoders="both"), root / "fp16")
    return root / "fp32", root / "fp16", report


def test_fp16_export_is_within_half_tolerance_of_fp32_pytorch_and_half_the_size(gated_fp32_fp16):
    fp32_dir, fp16_dir, report = gated_fp32_fp16
    parity = report["parity"]
    assert report["dtype"] == "fp16" and parity["reference"] == "fp32 PyTorch model"
    assert set(parity["max_abs_diff"]) == {*GRAPHS, DECODER_MERGED}
    for name, w in parity["worst"].items():
        assert w["ratio"] <= 0.5, (name, w)  # well inside the allowance, not just under it
        assert w["abs_diff"] <= HALF_ATOL + HALF_RTOL * w["scale"]
    assert parity["max_abs_diff"][ENCODER] < 0.02 and parity["max_abs_diff"][DECODER_WITH_PAST] < 0.1
    assert parity["token_agreement"]["agreement"] >= 0.95
    # logits fp32, everything handed between graphs fp16
    assert parity["dtypes"][DECODER] == {"encoder_hidden_states": "float16", "logits": "float32", "cache": "float16"}
    assert parity["dtypes"][ENCODER] == {"last_hidden_state": "float16"}
    ratio = _weight_bytes(fp16_dir) / _weight_bytes(fp32_dir)
    assert 0.5 < ratio < 0.62, ratio  # fp16 weights but the wo matrices (fp32)
    meta = json.loads((fp16_dir / "t5compress.json").read_text())
    assert meta["config"]["dtype"] == "fp16"


def test_wo_is_fp32_in_the_graph_and_the_rest_fp16(gated_fp32_fp16):
    import onnx
    from onnx import TensorProto

    _, fp16_dir, _ = gated_fp32_fp16
    model = onnx.load(str(fp16_dir / f"{ENCODER}.onnx"))
    kinds = {t.data_type for t in model.graph.initializer if len(t.dims) == 2}
    assert kinds == {TensorProto.FLOAT16, TensorProto.FLOAT}
    fp32_mats = [tuple(t.dims) for t in model.graph.initializer
                 if len(t.dims) == 2 and t.data_type == TensorProto.FLOAT]
    cfg = json.loads((fp16_dir / "config.json").read_text())
    # MatMul weights are (in, out): every fp32 matrix is a wo, (d_ff, d_model), one per encoder layer
    assert fp32_mats == [(cfg["d_ff"], cfg["d_model"])] * cfg["num_layers"]


def test_runtime_generates_from_the_fp16_export_like_fp32(gated_fp32_fp16, tiny_gated_dir):
    fp32_dir, fp16_dir, _ = gated_fp32_fp16
    ids, mask = make_batch(256, 6, 12, np.random.default_rng(3))
    for decoders in ("separate", "merged"):
        rt16 = load_runtime(fp16_dir, decoders=decoders)
        rt32 = load_runtime(fp32_dir, decoders=decoders)
        for beams in (1, 3):
            got = rt16.generate(ids, mask, max_new_tokens=10, num_beams=beams)
            want = rt32.generate(ids, mask, max_new_tokens=10, num_beams=beams)
            same = np.mean([(g == w).all() for g, w in zip(got, want, strict=True)])
            assert same >= 5 / 6, (decoders, beams, got, want)
    texts = load_runtime(fp16_dir).generate_text(["translate: hello", "abc"], max_new_tokens=6)
    assert len(texts) == 2


def test_half_model_keeps_wo_values_exactly(tiny_gated_dir):
    """wo keeps the source's fp32 values (not an fp16 round trip): beyond 65504, and finer than fp16 resolves."""
    model = load_model(tiny_gated_dir, dtype=torch.float32)
    wo = model.encoder.block[0].layer[-1].DenseReluDense.wo
    with torch.no_grad():
        wo.weight[0, 0], wo.weight[0, 1] = 1e6, 1.0 + 2**-20
    half = half_model(model, "fp16")
    for (name, a), b in zip(model.named_parameters(), half.parameters(), strict=True):
        if name.endswith(".wo.weight"):
            assert b.dtype == torch.float32 and torch.equal(a, b), name
        else:
            assert b.dtype == torch.float16, name


def test_keep_fp32_covers_what_transformers_keeps():
    from transformers import T5ForConditionalGeneration

    assert set(T5ForConditionalGeneration._keep_in_fp32_modules or ()) <= set(KEEP_FP32)


def _wo_overflows(model, ids, mask, dec) -> bool:
    """Whether any `wo` output of `model` holds inf on these inputs (a forward hook on every wo)."""
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(bool(torch.isinf(out).any())))
             for n, m in model.named_modules() if n.endswith(".wo")]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    for h in hooks:
        h.remove()
    return any(seen)


@pytest.fixture(scope="module")
def overflowing_dir(tmp_path_factory) -> tuple[Path, float]:
    """A Flan-shaped model whose first encoder and decoder layer's `wo` is scaled up until a plain `.half()` PyTorch
    model (wo in fp16 too) overflows to inf in it on the export check's inputs; returns the dir and the scale."""
    src = build_tiny_t5(tmp_path_factory.mktemp("models") / "overflow-src", seed=4, feed_forward_proj="gated-gelu",
                        tie_word_embeddings=False)
    model = load_model(src, dtype=torch.float32)
    ids, mask = (torch.from_numpy(a) for a in make_batch(model.config.vocab_size, 3, 13, np.random.default_rng(0)))
    dec = ids[:, :6]
    scale = 1.0
    while not _wo_overflows(model.half(), ids, mask, dec):
        model.float()
        with torch.no_grad():
            for stack in (model.encoder, model.decoder):
                stack.block[0].layer[-1].DenseReluDense.wo.weight.mul_(4.0)
        scale *= 4.0
        assert scale < 1e9
    out = tmp_path_factory.mktemp("models") / "overflow"
    save_model_dir(model.float(), byte_level(), out)
    return out, scale


def test_fp16_export_does_not_overflow_where_fp16_wo_does(overflowing_dir, tmp_path):
    src, scale = overflowing_dir
    model = load_model(src, dtype=torch.float32)
    ids, mask = make_batch(model.config.vocab_size, 3, 13, np.random.default_rng(0))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     decoder_input_ids=torch.from_numpy(ids[:, :6]))
        naive = model.half()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             decoder_input_ids=torch.from_numpy(ids[:, :6]))
    hidden32 = want.encoder_last_hidden_state.numpy()
    naive_err = np.abs(naive.encoder_last_hidden_state.float().numpy() - hidden32)
    naive_err = float(np.nan_to_num(naive_err, nan=np.inf).max())
    assert scale >= 4 and naive_err > 0.5, naive_err  # fp16 wo overflowed and it shows in the output

    result = runner.invoke(app, ["export", str(src), str(tmp_path / "fp16"), "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    assert "no NaN or inf" in result.output
    graphs = open_onnx(tmp_path / "fp16", [ENCODER])
    hidden16 = graphs[ENCODER].run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    assert np.isfinite(hidden16).all()
    ours_err = float(np.abs(hidden16.astype(np.float32) - hidden32).max())
    assert ours_err <= HALF_ATOL + HALF_RTOL * float(np.abs(hidden32).max()) and ours_err < naive_err / 10
    report = json.loads((tmp_path / "fp16" / "report.json").read_text())
    assert all(w["ratio"] <= 1 for w in report["parity"]["worst"].values())
    texts = load_runtime(tmp_path / "fp16").generate(ids, mask, max_new_tokens=5, num_beams=2)
    assert texts.shape[0] == 3


@pytest.mark.parametrize("case", ["bf16", "torchscript", "qat", "bad"])
def test_cli_refusals_are_one_line_and_write_nothing(case, tiny_model_dir, tmp_path):
    src, out = tiny_model_dir, tmp_path / "out"
    args = {"bf16": ["--dtype", "bf16"], "torchscript": ["--dtype", "fp16", "--torchscript"],
            "qat": ["--dtype", "fp16"], "bad": ["--dtype", "int4"]}[case]
    needle = {"bf16": "no bfloat16 kernels", "torchscript": "applies to ONNX exports", "qat": "QAT model dir",
              "bad": "unknown dtype 'int4'"}[case]
    if case == "qat":  # a model dir with learned int8 scales beside its weights is what `qat` writes
        from t5compress.kinds import SCALES_JSON

        src = tmp_path / "qat"
        save_model_dir(load_model(tiny_model_dir, dtype=torch.float32), byte_level(), src)
        (src / SCALES_JSON).write_text("{}")
    result = runner.invoke(app, ["export", str(src), str(out), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.output
    assert not out.exists()


@pytest.mark.parametrize("mode", ["--dynamic", "--static"])
def test_quantize_refuses_an_fp16_export_in_one_line(gated_fp32_fp16, tmp_path, mode):
    fp16 = gated_fp32_fp16[1]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in fp16.iterdir())
    result = runner.invoke(app, ["quantize", str(fp16), str(tmp_path / "q"), mode, "--calib-data", str(fp16)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "is an fp16 export" in lines[0], result.output
    assert not (tmp_path / "q").exists() and sorted((p.name, p.stat().st_mtime_ns) for p in fp16.iterdir()) == before


def test_config_rejects_half_options_naming_the_field():
    with pytest.raises(ConfigError, match="half_rtol"):
        ExportConfig(dtype="fp16", half_rtol=-1)
    assert half_model(torch.nn.Linear(2, 2), "fp16").weight.dtype == torch.float16
    assert ExportConfig().dtype == "fp32"
