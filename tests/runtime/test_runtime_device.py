"""--device: cpu, cuda[:N], auto. On this CPU-only machine CUDA is always missing, so every path that names what is
missing is run for real (no CUDA provider; a CUDA provider that cannot start, with the provider list faked), and
auto must give the CPU's tokens exactly. The gpu extra's range and the Makefile's agree."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ModelError
from t5compress.export import ExportConfig, run
from t5compress.runtime import device as dev
from t5compress.runtime import load_runtime

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_parse_device_accepts_the_documented_names_only():
    assert dev.parse_device("cpu") == dev.Device("cpu")
    assert dev.parse_device("CUDA:1") == dev.Device("cuda", 1) and dev.parse_device("cuda").name == "cuda:0"
    assert dev.parse_device("auto").name == "auto"
    for bad in ("gpu", "cpu:1", "cuda:x", "auto:0", ""):
        with pytest.raises(ModelError, match="unknown device"):
            dev.parse_device(bad)


def test_cuda_without_a_cuda_provider_is_one_line_naming_it(tiny_export):
    assert dev.CUDA not in dev.available_providers()  # this machine's onnxruntime is the CPU build
    with pytest.raises(ModelError, match="has no CUDA provider.*gpu-env"):
        load_runtime(tiny_export, device="cuda")
    result = runner.invoke(app, ["generate", str(tiny_export), "hello", "--device", "cuda:0"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "no CUDA provider" in lines[0], result.output


def test_a_cuda_provider_that_cannot_start_is_not_a_silent_cpu_run(tiny_export, monkeypatch):
    # A CUDA provider listed but unable to start: ONNX Runtime opens a CPU session; we must refuse it.
    monkeypatch.setattr(dev, "available_providers", lambda: [dev.CUDA, dev.CPU])
    with pytest.raises(ModelError, match="could not start.*nothing runs on the CPU unless --device auto"):
        load_runtime(tiny_export, device="cuda:0")
    rt = load_runtime(tiny_export, device="auto")  # auto may fall back, and says where it runs
    assert rt.device == "cpu"


def test_auto_on_a_cpu_machine_gives_the_cpu_tokens(tiny_export):
    ids = np.random.default_rng(0).integers(3, 200, (3, 9))
    cpu = load_runtime(tiny_export, device="cpu")
    auto = load_runtime(tiny_export, device="auto")
    assert cpu.device == auto.device == "cpu"
    for beams in (1, 3):
        np.testing.assert_array_equal(auto.generate(ids, max_new_tokens=6, num_beams=beams),
                                      cpu.generate(ids, max_new_tokens=6, num_beams=beams))
    result = runner.invoke(app, ["generate", str(tiny_export), "hello", "--device", "auto", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output


def test_torchscript_on_cuda_is_one_line(tiny_model_dir, tmp_path):
    ts = tmp_path / "ts"
    run(tiny_model_dir, ExportConfig(format="torchscript"), ts)
    with pytest.raises(ModelError, match="TorchScript export.*CPU only"):
        load_runtime(ts, device="cuda")
    assert load_runtime(ts, device="auto").device == "cpu"


def test_both_onnxruntime_builds_installed_is_named(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda dist: {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}[dist])
    monkeypatch.setattr(dev, "available_providers", lambda: [dev.CPU])
    with pytest.raises(ModelError, match="both installed and share one module"):
        dev.providers_for("cuda")


def test_gpu_extra_and_makefile_name_the_same_range():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    makefile = re.search(r"^ORT_GPU := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert extra == [makefile] and makefile.startswith("onnxruntime-gpu")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "onnxruntime>=1.32,<1.33" in deps  # the CPU install stays as it is


@pytest.mark.parametrize("device, needle", [("cuda", "no CUDA provider"), ("gpu0", "device: choose cpu, cuda")])
def test_bench_device_refusals_are_one_line_before_anything_is_measured(device, needle, tiny_export, tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(app, ["bench", str(tiny_export), "--out", str(out), "--device", device])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], result.output
    assert not out.exists()


def test_bench_labels_an_fp16_export_as_fp16(tiny_gated_dir, tmp_path):
    from t5compress.bench.variants import resolve_all

    run(tiny_gated_dir, ExportConfig(dtype="fp16"), tmp_path / "fp16")
    (variant,) = resolve_all([str(tmp_path / "fp16")])
    assert variant.precision == "fp16" and variant.label == "ONNX fp16"
