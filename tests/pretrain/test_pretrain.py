"""Pre-training: T5's span-corruption arithmetic and collator exactly, a tiny model that learns, resume, bad input,
and the output dir going through `train` and `export` unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError, DataError
from t5compress.pretrain import (
    PretrainConfig,
    SpanCorruption,
    apply_mask,
    compute_input_and_target_lengths,
    noise_mask,
    pack,
    run,
)
from t5compress.pretrain.corpus import Corpus
from t5compress.pretrain.toy import write_toy_corpus
from t5compress.train.loop import TrainConfig

TINY = dict(d_model=64, d_ff=256, d_kv=16, num_heads=4)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a loaded 2-core machine, two spinning OpenMP threads run ~10x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return write_toy_corpus(tmp_path_factory.mktemp("corpus") / "toy.jsonl", 3000, seed=0)


def _cfg(**train) -> PretrainConfig:
    base = dict(max_steps=60, batch_size=16, optimizer="adamwscale", lr=2e-2, warmup_steps=6, eval_every=20,
                eval_max_examples=64, metric="loss")
    base.update(train)
    return PretrainConfig(model="t5-efficient-tiny-nl2", overrides=TINY, vocab_size=300, inputs_length=64,
                          train=TrainConfig(**base))


# --- the span-corruption arithmetic and collator ---------------------------------------------------------------

def test_lengths_match_t5s_reference_numbers():
    assert compute_input_and_target_lengths(512, 0.15, 3.0) == (568, 114)  # T5 / nanoT5: 568 raw tokens
    assert compute_input_and_target_lengths(128) == (141, 29)  # 141 -> 21 noise in 7 spans: 120+7+1 in, 21+7+1 out
    assert compute_input_and_target_lengths(10) == (10, 4)  # the shortest with one whole noise span
    with pytest.raises(ConfigError, match="inputs_length: 8 is too short .* use inputs_length >= 10"):
        compute_input_and_target_lengths(8)
    with pytest.raises(ConfigError, match="inputs_length: 4 is too short"):
        PretrainConfig(inputs_length=4)


def test_collator_on_known_input_gives_exactly_the_expected_inputs_and_targets():
    tokens = np.array([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    mask = np.array([[0, 0, 1, 1, 0, 0, 0, 1, 1, 1]], dtype=bool)
    out = apply_mask(tokens, mask, sentinel_ids=(99, 98, 97), eos_id=1)
    assert out["input_ids"].tolist() == [[10, 11, 99, 14, 15, 16, 98, 1]]
    assert out["labels"].tolist() == [[99, 12, 13, 98, 17, 18, 19, 1]]


def _restore(inputs: list[int], labels: list[int], sentinels: tuple[int, ...]) -> list[int]:
    """Put each noise span of the target back in place of its sentinel in the input."""
    spans, cur = {}, None
    for t in labels[:-1]:
        if t in sentinels:
            cur = t
            spans[cur] = []
        else:
            spans[cur].append(t)
    return [x for t in inputs[:-1] for x in (spans[t] if t in sentinels else [t])]


def test_collator_batches_have_exact_lengths_ordered_sentinels_and_lose_no_token():
    sentinels = tuple(range(1000, 900, -1))  # extra_id_0 at the top, counting down, as in T5's vocabulary
    sc = SpanCorruption(sentinel_ids=sentinels, eos_id=1, inputs_length=512)
    assert (sc.tokens_length, sc.targets_length) == (568, 114)
    rng = np.random.default_rng(0)
    tokens = rng.permutation(np.arange(2000, 2000 + 8 * 568)).reshape(8, 568)  # distinct: a duplicate would show
    out = sc(tokens, np.random.default_rng(1))
    assert out["input_ids"].shape == (8, 512) and out["labels"].shape == (8, 114)
    for row, inp, lab in zip(tokens, out["input_ids"].tolist(), out["labels"].tolist(), strict=True):
        assert inp[-1] == 1 and lab[-1] == 1
        used = [t for t in inp if t in sentinels]
        assert used == list(sentinels[: len(used)]) == [t for t in lab if t in sentinels]  # in order, both sides
        assert len(used) == 28  # round(85 / 3) spans of round(568 * .15) = 85 noise tokens
        assert lab[0] == sentinels[0]  # the target starts with extra_id_0 (spans start with non-noise)
        assert _restore(inp, lab, sentinels) == row.tolist()  # every token once, in its place
    assert not np.array_equal(out["input_ids"][0], out["input_ids"][1])  # each row has its own mask


def test_noise_mask_has_t5s_span_statistics():
    mask = noise_mask(np.random.default_rng(0), 2000, 568, 0.15, 3.0)
    assert (mask.sum(axis=1) == 85).all()
    starts = mask & ~np.pad(mask[:, :-1], ((0, 0), (1, 0)))
    assert (starts.sum(axis=1) == 28).all()
    assert not mask[:, 0].any() and mask[:, -1].all()  # non-noise first, noise last
    # every split of the 85 noise tokens into 28 spans is equally likely: span lengths are >= 1 with mean 85/28
    edges = np.flatnonzero(np.diff(np.pad(mask[0].astype(int), 1)))  # start, end, start, end, ...
    lengths = edges[1::2] - edges[0::2]
    assert len(lengths) == 28 and lengths.min() >= 1 and lengths.sum() == 85
    assert abs(mask[:, 100].mean() - 0.15) < 0.03  # each position is noise about 15% of the time


def test_pack_fills_blocks_exactly_in_stream_order():
    docs = [[5] * 7 + [1], [6] * 3 + [1], [7] * 20 + [1]]
    blocks = list(pack(docs, 10))
    assert len(blocks) == 3 and all(len(b) == 10 for b in blocks)
    assert np.concatenate(blocks).tolist() == sum(docs, [])[:30]


def test_adamwscale_scales_adams_step_by_the_parameters_rms():
    from t5compress.train.optim import AdamWScale

    big = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # rms sqrt(12.5) = 3.5355
    tiny = torch.nn.Parameter(torch.tensor([1e-6, -1e-6]))  # rms below the 1e-3 floor
    opt = AdamWScale([big, tiny], lr=0.1)
    big.grad, tiny.grad = torch.tensor([1.0, -2.0]), torch.tensor([-1.0, 1.0])
    opt.step()
    # Adam's first step is lr * sign(grad); here times max(1e-3, rms(p))
    assert torch.allclose(big.detach(), torch.tensor([3.0 - 0.35355, 4.0 + 0.35355]), atol=1e-4)
    assert torch.allclose(tiny.detach(), torch.tensor([1e-6 + 1e-4, -1e-6 - 1e-4]), atol=1e-8)


# --- pre-training a tiny model ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_pretraining_lowers_held_out_loss_and_the_dir_fine_tunes_and_exports(toy, tmp_path, demo_jsonl):
    out = tmp_path / "pre"
    report = run(str(toy), _cfg(), out, progress=False)
    before, after = report["eval_before"]["loss"], report["eval"]["loss"]
    assert before > 5.0 and after < 0.65 * before, (before, after)  # measured: 6.17 -> 3.34 (fp32 and bf16 alike)
    assert report["objective"]["tokens_length"] == 70 and report["objective"]["targets_length"] == 14
    assert report["train"]["tokens_per_second"] > 0 and not (tmp_path / "pre.partial").exists()
    meta = json.loads((out / "t5compress.json").read_text())
    assert meta["stage"] == "pretrain" and meta["config"]["train"]["optimizer"] == "adamwscale"

    from t5compress.data import DataConfig
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.train import stage as training

    ft = training.run(str(out), training.FinetuneConfig(
        train_data=str(demo_jsonl), data=DataConfig(max_source_length=32, max_target_length=32),
        train=TrainConfig(max_steps=8, batch_size=16, eval_every=8, eval_max_examples=8, metric="loss")),
        tmp_path / "ft", progress=False)
    assert ft["train"]["steps"] == 8 and ft["eval"]["loss"] > 0
    exported = export(str(tmp_path / "ft"), ExportConfig(format="onnx"), tmp_path / "onnx")
    assert max(exported["parity"]["max_abs_diff"].values()) < 1e-3  # export verified it against PyTorch
    assert exported["parity"]["generation"]["identical"]


def test_continued_pretraining_of_a_checkpoint_keeps_its_tokenizer(toy, tiny_model_dir, tmp_path):
    cfg = PretrainConfig(model=str(tiny_model_dir), inputs_length=64, train=TrainConfig(
        max_steps=30, batch_size=8, optimizer="adamwscale", lr=1e-2, warmup_steps=3, eval_every=30,
        eval_max_examples=16, metric="loss"))
    report = run(str(toy), cfg, tmp_path / "cont", progress=False)
    assert report["eval"]["loss"] < 0.9 * report["eval_before"]["loss"], report  # measured: 5.99 -> 5.16 (bytes)
    assert report["model"]["vocab_size"] == 384  # the byte tokenizer's model, not a new one
    meta = json.loads((tmp_path / "cont" / "t5compress.json").read_text())
    assert meta["parent"]["path"] == str(tiny_model_dir.resolve())


def _kill_at(step):
    def hook(state):
        if state["step"] == step:
            raise KeyboardInterrupt

    return hook


def test_resume_after_interruption_ends_where_an_uninterrupted_run_ends(toy, tmp_path):
    cfg = _cfg(max_steps=12, eval_every=6, save_every=4, eval_max_examples=16)
    run(str(toy), cfg, tmp_path / "clean", progress=False)
    with pytest.raises(KeyboardInterrupt):
        run(str(toy), cfg, tmp_path / "resumed", progress=False, on_step=_kill_at(7))
    assert (tmp_path / "resumed.partial" / "ckpt-0000004").is_dir() and not (tmp_path / "resumed").exists()
    report = run(str(toy), cfg, tmp_path / "resumed", progress=False, resume=True)
    assert report["train"]["resumed_from_step"] == 4 and report["train"]["steps"] == 12
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("clean", "resumed"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


# --- bad input -------------------------------------------------------------------------------------------------

def test_bad_corpora_fail_with_one_line_and_write_nothing(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="the corpus has no text"):
        run(str(empty), _cfg(), tmp_path / "o1", progress=False)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"body": "a b c"}\n')
    with pytest.raises(DataError, match=r"wrong.jsonl:1: no field 'text' \(fields: body\); set --text-field"):
        run(str(wrong), _cfg(), tmp_path / "o2", progress=False)
    with pytest.raises(DataError, match="does not exist"):
        run(str(tmp_path / "missing.jsonl"), _cfg(), tmp_path / "o3", progress=False)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="no text files in the folder"):
        run(str(tmp_path / "folder"), _cfg(), tmp_path / "o4", progress=False)
    with pytest.raises(ConfigError, match="max_steps"):
        PretrainConfig(train=TrainConfig(max_steps=0))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("o")]


def test_folders_of_text_and_jsonl_stream_in_order_with_a_held_out_share(tmp_path):
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "c" / "sub" / "b.jsonl").write_text('{"text": "three"}\n{"text": "four"}\n')
    corpus = Corpus(str(tmp_path / "c"), holdout_every=2)
    assert list(corpus.documents()) == ["one", "two", "three", "four"]
    assert list(corpus.split(train=True)) == ["one", "three"] and list(corpus.split(train=False)) == ["two", "four"]

    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["five", "six"]})}).save_to_disk(
        str(tmp_path / "ds"))
    assert list(Corpus(str(tmp_path / "ds"), text_field="body").documents()) == ["five", "six"]
    with pytest.raises(DataError, match=r"no field 'text' \(fields: body\)"):
        list(Corpus(str(tmp_path / "ds")).documents())


# --- CLI -------------------------------------------------------------------------------------------------------

def test_cli_pretrain_happy_path_and_bad_input(toy, tmp_path):
    runner = CliRunner()
    out = tmp_path / "runs" / "pre"
    args = ["pretrain", str(toy), str(out), "--arch", "t5-efficient-tiny-nl1", "-o", "d_model=32", "-o", "d_ff=64",
            "-o", "d_kv=8", "--vocab-size", "200", "--inputs-length", "32", "--max-steps", "4", "--batch-size", "4",
            "--warmup-steps", "1", "--eval-every", "2", "--eval-max-examples", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out span-corruption loss" in result.output and "tokens/s" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps"] == 4 and report["model"]["encoder_layers"] == 1
    bad = runner.invoke(app, ["pretrain", str(toy), str(tmp_path / "x"), "--inputs-length", "5"])
    assert bad.exit_code != 0 and "inputs_length: 5 is too short" in bad.output and "Traceback" not in bad.output
    again = runner.invoke(app, args)
    assert again.exit_code != 0 and "already exists" in again.output
    assert not (tmp_path / "x").exists()
