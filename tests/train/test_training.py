"""Fine-tuning: the loss goes down, the output is a plain HF model dir, and resume ends where a clean run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from t5compress.data import DataConfig, encode, load_examples
from t5compress.model.load import load_model, load_tokenizer
from t5compress.train import stage as training
from t5compress.train.evaluation import evaluate
from t5compress.train.loop import TrainConfig
from tests.conftest import build_tiny_t5


def _cfg(data, **train) -> training.FinetuneConfig:
    base = dict(max_steps=12, batch_size=16, lr=3e-3, eval_every=6, eval_max_examples=16, save_every=4,
                metric="loss")
    base.update(train)
    return training.FinetuneConfig(train_data=str(data), data=DataConfig(max_target_length=48),
                                   train=TrainConfig(**base))


def test_finetuning_lowers_loss_and_writes_a_plain_model_dir(tiny_model_dir, demo_jsonl, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    examples = load_examples(str(demo_jsonl), DataConfig())[:32]
    before = evaluate(load_model(tiny_model_dir), tok, examples, encode(examples, tok, DataConfig()), max_new_tokens=4)
    out = tmp_path / "ft"
    report = training.run(str(tiny_model_dir), _cfg(demo_jsonl, max_steps=60, eval_every=30, lr=5e-3), out,
                          progress=False)
    after = evaluate(load_model(out), tok, examples, encode(examples, tok, DataConfig()), max_new_tokens=4)
    assert after["loss"] < 0.75 * before["loss"], (before["loss"], after["loss"])
    assert report["train"]["steps"] == 60 and report["eval"]["step"] in (30, 60)
    # The contract: plain transformers loads it, with lineage and report beside the weights.
    from transformers import T5ForConditionalGeneration

    T5ForConditionalGeneration.from_pretrained(out)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "t5compress.json",
            "report.json"} <= {p.name for p in out.iterdir()}
    assert not (tmp_path / "ft.partial").exists()


class _Killed(Exception):
    pass


def _kill_at(step):
    def hook(state):
        if state["step"] == step:
            raise _Killed()

    return hook


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_resume_after_interruption_ends_where_an_uninterrupted_run_ends(tmp_path, demo_jsonl):
    model_dir = build_tiny_t5(tmp_path / "m", dropout_rate=0.1)  # dropout: the RNG state must be restored too
    cfg = _cfg(demo_jsonl)
    training.run(str(model_dir), cfg, tmp_path / "clean", progress=False)

    with pytest.raises(_Killed):
        training.run(str(model_dir), cfg, tmp_path / "resumed", progress=False, on_step=_kill_at(7))
    assert (tmp_path / "resumed.partial" / "ckpt-0000004").is_dir() and not (tmp_path / "resumed").exists()
    report = training.run(str(model_dir), cfg, tmp_path / "resumed", progress=False, resume=True)
    assert report["train"]["resumed_from_step"] == 4

    a, b = _weights(tmp_path / "clean"), _weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_resume_refuses_other_options_and_missing_runs(tmp_path, demo_jsonl, tiny_model_dir):
    from t5compress.errors import OutputError

    with pytest.raises(OutputError, match="nothing to resume"):
        training.run(str(tiny_model_dir), _cfg(demo_jsonl), tmp_path / "x", resume=True, progress=False)
    with pytest.raises(_Killed):
        training.run(str(tiny_model_dir), _cfg(demo_jsonl), tmp_path / "y", progress=False, on_step=_kill_at(5))
    with pytest.raises(OutputError, match="other options"):
        training.run(str(tiny_model_dir), _cfg(demo_jsonl, lr=1e-3), tmp_path / "y", resume=True, progress=False)
    with pytest.raises(OutputError, match="pass --resume"):
        training.run(str(tiny_model_dir), _cfg(demo_jsonl), tmp_path / "y", progress=False)


@pytest.mark.slow
def test_kill_9_then_resume_from_the_cli(tmp_path, demo_jsonl):
    """A real SIGKILL in the middle of training; `--resume` finishes with the same weights as a clean run."""
    model_dir = build_tiny_t5(tmp_path / "m", dropout_rate=0.1)
    args = [sys.executable, "-m", "t5compress.cli", "train", str(model_dir), str(demo_jsonl)]
    opts = ["--max-steps", "100", "--batch-size", "8", "--save-every", "2", "--eval-every", "50",
            "--eval-max-examples", "8", "--metric", "loss", "--lr", "1e-3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(args + [str(tmp_path / "clean")] + opts, check=True, env=env, capture_output=True)

    proc = subprocess.Popen(args + [str(tmp_path / "killed")] + opts, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    latest = tmp_path / "killed.partial" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and not (latest.exists() and "ckpt-00000" in latest.read_text()
                                          and int(latest.read_text().split("ckpt-")[1][:7]) >= 20):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists(), "the run finished before it could be killed"

    done = subprocess.run(args + [str(tmp_path / "killed")] + opts + ["--resume"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    a, b = _weights(tmp_path / "clean"), _weights(tmp_path / "killed")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert torch.equal(a["shared.weight"], b["shared.weight"])


def test_early_stopping_stops_after_patience_evaluations_without_improvement(tiny_model_dir, demo_jsonl, tmp_path):
    # lr ~0: exact match stays at 0, so every evaluation after the first is "no improvement".
    cfg = _cfg(demo_jsonl, max_steps=40, eval_every=2, patience=2, metric="exact_match", lr=1e-12)
    report = training.run(str(tiny_model_dir), cfg, tmp_path / "es", progress=False)
    assert report["train"]["stopped_early"] and report["train"]["steps"] == 6
    assert [h["step"] for h in report["train"]["history"]] == [2, 4, 6]
    assert report["eval"]["step"] == 2  # the best (first) checkpoint is the one kept


def test_adafactor_inverse_sqrt_label_smoothing_and_accumulation_train(tiny_gated_dir, demo_jsonl, tmp_path):
    cfg = _cfg(demo_jsonl, max_steps=30, eval_every=15, optimizer="adafactor", schedule="inverse_sqrt", lr=1e-2,
               label_smoothing=0.1, grad_accum=2, batch_size=8, warmup_steps=5)
    report = training.run(str(tiny_gated_dir), cfg, tmp_path / "af", progress=False)
    first, last = report["train"]["history"][0]["loss"], report["train"]["history"][-1]["loss"]
    assert last < first and report["train"]["warmup_steps"] == 5


def test_schedules_follow_their_formulas():
    from t5compress.train.loop import SCHEDULES

    assert SCHEDULES["cosine"](0, 10, 110) == pytest.approx(0.1)
    assert SCHEDULES["cosine"](60, 10, 110) == pytest.approx(0.5)
    assert SCHEDULES["cosine"](110, 10, 110) == pytest.approx(0.0)
    assert SCHEDULES["inverse_sqrt"](40, 10, 100) == pytest.approx((10 / 40) ** 0.5)
    assert SCHEDULES["constant"](50, 10, 100) == 1.0


@pytest.mark.slow
def test_the_same_command_runs_under_accelerate_launch_with_two_processes(tiny_model_dir, demo_jsonl, tmp_path):
    """DDP on two CPU processes (gloo): what `accelerate launch --multi_gpu` does on GPUs."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [accelerate, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "t5compress.cli", "train", str(tiny_model_dir), str(demo_jsonl),
           str(tmp_path / "ddp"), "--max-steps", "8", "--eval-every", "4", "--batch-size", "8",
           "--eval-max-examples", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "ddp" / "report.json").read_text())
    assert report["train"]["steps"] == 8 and [h["step"] for h in report["train"]["history"]] == [4, 8]
    assert not (tmp_path / "ddp.partial").exists()
