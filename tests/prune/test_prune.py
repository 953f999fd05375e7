"""Structured pruning: exact removal of zero-importance units, plain and per-layer dirs, export, recovery, CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.data import DataConfig
from t5compress.errors import ConfigError
from t5compress.model import units
from t5compress.model.load import load_model
from t5compress.prune import PruneConfig, run
from t5compress.prune.importance import SCORES
from t5compress.prune.recover import RecoverConfig, recovery_lr, still_improving
from t5compress.prune.schedule import SCHEDULES, Targets, apply_plan
from t5compress.train.loop import TrainConfig

torch.set_num_threads(1)
runner = CliRunner()
D_KV = 8  # the fixtures' head size


def _inputs(batch: int = 2, enc_len: int = 12, dec_len: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """A padded batch. Bit-identity is asserted at these lengths: at a few others (e.g. 9 to 11 tokens) the CPU
    batched matmul of q and k takes another kernel when the head count changes, and results differ in the last bit
    (same maths, other summation order); `test_..._at_every_length` bounds that difference."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (batch, enc_len), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, enc_len - 3:] = 0
    labels = torch.randint(3, 250, (batch, dec_len), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def _logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).logits


def _zero_head(attn, h: int) -> None:
    rows = slice(h * D_KV, (h + 1) * D_KV)
    with torch.no_grad():
        for lin in (attn.q, attn.k, attn.v):
            lin.weight[rows] = 0
        attn.o.weight[:, rows] = 0


def _zero_channels(ff, channels: slice) -> None:
    ins, wo = units.ffn_linears(ff)
    with torch.no_grad():
        for lin in ins:
            lin.weight[channels] = 0
        wo.weight[:, channels] = 0


def _prune(model, criterion: str, schedule: str, batches: list[dict], **targets):
    ratios = {k.replace("_", ".", 1): v for k, v in targets.items() if not k.endswith("_layers")}  # encoder.heads
    t = Targets(ratios, targets.get("encoder_layers"), targets.get("decoder_layers"))
    plan = SCHEDULES[schedule](model, SCORES[criterion](model, batches), t)
    apply_plan(model, plan)
    return plan


def _zeros(per_layer: list[torch.Tensor]) -> set[tuple[int, int]]:
    return {(i, int(j)) for i, s in enumerate(per_layer) for j in torch.nonzero(s == 0).flatten()}


def _batches() -> list[dict]:
    return [_inputs(seed=s) for s in (1, 2)]


@pytest.mark.parametrize("schedule", ["uniform", "global"])
def test_zero_importance_heads_are_removed_bit_identically(tiny_model_dir, schedule):
    model = load_model(tiny_model_dir)
    for block in model.encoder.block:
        _zero_head(units.self_attn(block), 1)
    for block in model.decoder.block:
        _zero_head(units.self_attn(block), 2)
    _zero_head(units.cross_attn(model.decoder.block[0]), 3)
    _zero_head(units.cross_attn(model.decoder.block[1]), 0)
    batch = _inputs()
    want = _logits(model, batch)
    zeroed = {"encoder.heads": {(0, 1), (1, 1)}, "decoder.heads": {(0, 2), (1, 2)}, "decoder.cross": {(0, 3), (1, 0)}}
    for name in SCORES:  # every criterion scores the zeroed heads exactly 0, and no other head
        scores = SCORES[name](model, _batches())
        for group, want_zero in zeroed.items():
            assert _zeros(scores[group]) == want_zero, (name, group)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # scoring leaves no trace
    plan = _prune(model, "taylor", schedule, _batches(), encoder_heads=0.25, decoder_heads=0.25, decoder_cross=0.25)
    assert plan["encoder.heads"] == [[0, 2, 3]] * 2 and plan["decoder.heads"] == [[0, 1, 3]] * 2
    assert plan["decoder.cross"] == [[0, 1, 2], [1, 2, 3]]
    assert units.self_attn(model.encoder.block[0]).q.weight.shape == (3 * D_KV, 32)
    assert torch.equal(_logits(model, batch), want)
    assert units.is_plain(model)  # same heads in every layer of a stack: the bias table is sliced, a plain T5


def test_heads_chosen_per_layer_keep_their_own_bias_columns(tiny_model_dir, tmp_path):
    """global: layers keep different heads; each adds its own columns of the stack's one relative-bias table."""
    model = load_model(tiny_model_dir)
    _zero_head(units.self_attn(model.encoder.block[0]), 1)
    _zero_head(units.self_attn(model.encoder.block[1]), 3)
    _zero_head(units.self_attn(model.decoder.block[0]), 0)
    _zero_head(units.cross_attn(model.decoder.block[1]), 2)
    _zero_head(units.cross_attn(model.decoder.block[1]), 1)
    batch = _inputs()
    want = _logits(model, batch)
    plan = _prune(model, "taylor", "global", _batches(), encoder_heads=0.25, decoder_heads=0.125,
                  decoder_cross=0.25)
    assert plan["encoder.heads"] == [[0, 2, 3], [0, 1, 2]] and plan["decoder.cross"] == [[0, 1, 2, 3], [0, 3]]
    assert torch.equal(_logits(model, batch), want)
    assert not units.is_plain(model)
    # The directory records per-layer sizes; t5compress rebuilds it exactly.
    from t5compress.model.load import load_tokenizer, save_model_dir

    save_model_dir(model, load_tokenizer(tiny_model_dir), tmp_path / "g")
    assert torch.equal(_logits(load_model(tmp_path / "g"), batch), want)


def test_head_removal_at_every_length_stays_within_rounding(tiny_model_dir):
    model = load_model(tiny_model_dir)
    for block in model.encoder.block:
        _zero_head(units.self_attn(block), 1)
    pruned = copy.deepcopy(model)
    for block in pruned.encoder.block:
        units.prune_heads(units.self_attn(block), [0, 2, 3])
    units.sync_stack(pruned.encoder)
    for enc_len in range(1, 17):
        batch = _inputs(batch=3, enc_len=enc_len + 3)
        assert (_logits(pruned, batch) - _logits(model, batch)).abs().max() < 1e-5


@pytest.mark.parametrize("fixture,criterion", [("tiny_model_dir", "magnitude"), ("tiny_gated_dir", "taylor"),
                                                ("tiny_gated_dir", "activation")])
def test_zero_importance_ffn_channels_are_removed_bit_identically(fixture, criterion, request):
    model = load_model(request.getfixturevalue(fixture))
    # Aligned blocks of 16 channels: the reduction in `wo` then sums the same partial sums in the same order. A
    # relu channel that never fires on the calibration data is also worth exactly 0 to taylor and activation, so
    # the relu model is scored by magnitude here.
    zeroed = {("encoder", 0): slice(16, 32), ("encoder", 1): slice(32, 48), ("decoder", 0): slice(0, 16),
              ("decoder", 1): slice(48, 64)}
    for (stack, i), channels in zeroed.items():
        _zero_channels(units.ffn(getattr(model, stack).block[i]), channels)
    batch = _inputs()
    want = _logits(model, batch)
    plan = _prune(model, criterion, "uniform", _batches(), encoder_ffn=0.25, decoder_ffn=0.25)
    for (stack, i), channels in zeroed.items():
        assert plan[f"{stack}.ffn"][i] == [c for c in range(64) if not channels.start <= c < channels.stop]
        assert units.ffn_width(units.ffn(getattr(model, stack).block[i])) == 48
    assert torch.equal(_logits(model, batch), want)


def test_identity_layers_are_dropped_bit_identically_and_block_0_hands_on_its_bias(tiny_model_dir, tmp_path):
    from transformers import T5ForConditionalGeneration

    from t5compress.model.load import load_tokenizer, save_model_dir

    model = load_model(tiny_model_dir)
    with torch.no_grad():  # zero output projections: block 0 of the encoder and block 1 of the decoder add nothing
        for block in (model.encoder.block[0], model.decoder.block[1]):
            for lin in (units.self_attn(block).o, units.ffn(block).wo):
                lin.weight.zero_()
            if units.cross_attn(block) is not None:
                units.cross_attn(block).o.weight.zero_()
    batch = _inputs()
    want = _logits(model, batch)
    for name in SCORES:
        scores = SCORES[name](model, _batches())
        assert float(scores["encoder.blocks"][0]) == 0 and float(scores["decoder.blocks"][1]) == 0, name
        assert float(scores["encoder.blocks"][1]) > 0 and float(scores["decoder.blocks"][0]) > 0, name
    plan = _prune(model, "taylor", "uniform", _batches(), encoder_layers=1, decoder_layers=1)
    assert plan["encoder.blocks"] == [1] and plan["decoder.blocks"] == [0]
    first = units.self_attn(model.encoder.block[0])
    assert first.has_relative_attention_bias and first.layer_idx == 0
    assert torch.equal(_logits(model, batch), want)
    save_model_dir(model, load_tokenizer(tiny_model_dir), tmp_path / "one-layer")
    plain = T5ForConditionalGeneration.from_pretrained(tmp_path / "one-layer").eval()
    assert plain.config.num_layers == 1 and plain.config.num_decoder_layers == 1
    assert torch.equal(_logits(plain, batch), want)


def _cfg(calib: Path, **kw) -> PruneConfig:
    base = dict(calib_data=str(calib), calib_examples=32, eval_max_examples=16, latency_examples=2,
                latency_new_tokens=4)
    base.update(kw)
    return PruneConfig(**base)


def test_uniform_dir_loads_with_plain_transformers_and_exports_with_parity(tiny_gated_dir, demo_jsonl, tmp_path):
    from transformers import T5ForConditionalGeneration

    from t5compress.export import ExportConfig
    from t5compress.export import run as export

    report = run(str(tiny_gated_dir), _cfg(demo_jsonl, heads=0.5, ffn=0.5), tmp_path / "u")
    assert report["plain"] and report["model"]["num_heads"] == 2 and report["model"]["d_ff"] == 32
    assert report["after_pruning"]["block_parameters"] < 0.55 * report["before"]["block_parameters"]
    assert report["after_pruning"]["bytes"] < report["before"]["bytes"]
    assert set(report["after_pruning"]["eval"]) >= {"loss", "exact_match", "rougeL", "bleu"}
    plain = T5ForConditionalGeneration.from_pretrained(tmp_path / "u").eval()
    batch = _inputs()
    assert torch.equal(_logits(plain, batch), _logits(load_model(tmp_path / "u"), batch))
    exported = export(tmp_path / "u", ExportConfig(), tmp_path / "u-onnx")
    assert max(exported["parity"]["max_abs_diff"].values()) < 1e-4 and exported["parity"]["generation"]["identical"]


def test_global_dir_with_dropped_layers_exports_with_parity(tiny_model_dir, demo_jsonl, tmp_path):
    from t5compress.export import ExportConfig
    from t5compress.export import run as export

    src = tmp_path / "deep"
    from tests.conftest import build_tiny_t5

    build_tiny_t5(src, num_layers=3, num_decoder_layers=3)
    report = run(str(src), _cfg(demo_jsonl, heads=0.4, ffn=0.5, schedule="global", decoder_layers=2),
                 tmp_path / "g")
    assert not report["plain"] and report["model"]["decoder_layers"] == 2
    heads = [b["cross_heads"] for b in report["layout"]["decoder"]["blocks"]]
    assert json.loads((tmp_path / "g" / "config.json").read_text())["t5compress_layout"] == report["layout"]
    exported = export(tmp_path / "g", ExportConfig(), tmp_path / "g-onnx")
    assert max(exported["parity"]["max_abs_diff"].values()) < 1e-4 and exported["parity"]["generation"]["identical"]
    assert heads  # recorded per layer


def test_config_and_plan_reject_bad_values():
    for kw, field in ((dict(heads=1.0), "heads"), (dict(ffn=-0.1), "ffn"), (dict(decoder_layers=0), "decoder_layers"),
                      (dict(criterion="nope"), "criterion"), (dict(schedule="nope"), "schedule")):
        with pytest.raises(ConfigError, match=field):
            PruneConfig(calib_data="x.jsonl", **kw)
    with pytest.raises(ConfigError, match="only a recovery can be resumed"):
        run("any", PruneConfig(calib_data="x.jsonl", heads=0.5), "out", resume=True)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, demo_jsonl) -> Path:
    """A tiny T5 trained on the demo task to real but imperfect skill (rougeL ~20, loss ~1.5 here)."""
    from t5compress.data import DataConfig
    from t5compress.train import stage as training
    from t5compress.train.loop import TrainConfig
    from tests.conftest import build_tiny_t5

    root = tmp_path_factory.mktemp("trained")
    init = build_tiny_t5(root / "init", d_model=64, d_ff=128, d_kv=16)
    cfg = training.FinetuneConfig(train_data=str(demo_jsonl), data=DataConfig(max_target_length=48),
                                  train=TrainConfig(max_steps=240, batch_size=16, lr=4e-3, eval_every=240,
                                                    eval_max_examples=24, metric="loss"))
    training.run(str(init), cfg, root / "trained", progress=False)
    return root / "trained"


def test_recovery_lr_falls_with_width_unless_given():
    rec = RecoverConfig(data="x.jsonl")
    assert [recovery_lr(rec, d) for d in (64, 128, 256, 512)] == [2e-3, 2e-3, 5e-4, 1.25e-4]
    assert rec.train.max_steps == 4800 and rec.train.eval_every == 400  # the run that closed the gap at d256
    given = RecoverConfig(data="x.jsonl", train=TrainConfig(max_steps=9, lr=3e-4), lr_per_width=False)
    assert recovery_lr(given, 512) == recovery_lr(given, 64) == 3e-4


def test_cli_recovery_evaluates_twelve_times_a_run_unless_told():
    from t5compress.cli.prune import RECOVERY_OPTIONS, _recover_cfg

    def every(steps: int, **given) -> int:
        opts = {p.name: p.default for p in RECOVERY_OPTIONS} | given
        return _recover_cfg("x.jsonl", None, steps, None, opts).train.eval_every

    assert (every(4800), every(600), every(4), every(4800, eval_every=7)) == (400, 50, 1, 7)


STEPS = 160  # recovery steps of the test below


@pytest.mark.slow
def test_default_recovery_wins_back_most_of_what_pruning_lost(trained_dir, demo_jsonl, tmp_path):
    """RecoverConfig's defaults (logit + layer-wise distillation, lr 2e-3 at this width), only shorter, against the old
    default (cross-entropy at lr 5e-4) with the same steps, on a model of real but imperfect skill."""
    import dataclasses

    rec = RecoverConfig(data=str(demo_jsonl), data_cfg=DataConfig(max_target_length=48))
    assert rec.distill and rec.kd.hidden_layers == "all" and recovery_lr(rec, 64) == 2e-3
    short = dataclasses.replace(rec.train, max_steps=STEPS, batch_size=16, eval_every=STEPS, eval_max_examples=24)
    old = dataclasses.replace(short, lr=5e-4)
    evals = {}
    for name, recover in (("default", dataclasses.replace(rec, train=short)),
                          ("old", dataclasses.replace(rec, distill=False, train=old))):
        cfg = _cfg(demo_jsonl, heads=0.5, ffn=0.5, eval_max_examples=24, latency_examples=0,
                   data=DataConfig(max_target_length=48), recover=recover)
        report = run(str(trained_dir), cfg, tmp_path / name, progress=False)
        evals["before"], evals["pruned"] = report["before"]["eval"], report["after_pruning"]["eval"]
        evals[name] = report["after_recovery"]["eval"]
    print(json.dumps({k: {m: v[m] for m in ("loss", "rougeL")} for k, v in evals.items()}))
    before, pruned, new, old = (evals[k] for k in ("before", "pruned", "default", "old"))
    assert 5 < before["rougeL"] < 95 and pruned["rougeL"] < before["rougeL"] - 5, (before, pruned)
    # Stated margins: the defaults win back most of what pruning lost (the loss nine tenths, the ROUGE-L of 24
    # examples half), and more than the old default did (measured on an AMD EPYC: rougeL 18.93 -> 0.0 -> 19.58, loss
    # 1.481 -> 2.526 -> 1.499, the old default 14.87 and 1.638; the fixture trains differently on an Intel Xeon with
    # AMX: rougeL 25.06 -> 1.28 -> 14.64, loss 1.471 -> 2.714 -> 1.516, the old default 11.31 and 1.727).
    assert new["rougeL"] >= pruned["rougeL"] + 0.5 * (before["rougeL"] - pruned["rougeL"]), evals
    assert new["loss"] <= pruned["loss"] - 0.9 * (pruned["loss"] - before["loss"]), evals
    assert new["loss"] < old["loss"] and new["rougeL"] > old["rougeL"], evals

def _ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_prune_with_recovery_then_recover_again(tiny_model_dir, demo_jsonl, tmp_path):
    common = ["--calib-examples", "32", "--eval-max-examples", "8", "--latency-examples", "1"]
    out = _ok(["prune", str(tiny_model_dir), str(tmp_path / "p"), "--calib-data", str(demo_jsonl), "--heads", "0.5",
               "--ffn", "0.5", "--recover-data", str(demo_jsonl), "--recover-steps", "4", "--distill",
               "--eval-every", "4", "--batch-size", "8", *common])
    assert "before" in out and "pruned" in out and "recovered" in out and "plain Hugging Face dir" in out
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert report["model"]["num_heads"] == 2 and report["recovery"]["train"]["steps"] == 4
    assert report["recovery"]["lr"] == 2e-3  # the default at d_model <= 128
    assert not (tmp_path / "p.partial").exists()
    # Recover later as its own command; the teacher defaults to the parent recorded in t5compress.json.
    out = _ok(["recover", str(tmp_path / "p"), str(tmp_path / "r"), "--data", str(demo_jsonl), "--steps", "3",
               "--distill", "--hidden-weight", "0.1", "--eval-every", "3", "--batch-size", "8", "--lr", "3e-3"])
    assert "3 steps" in out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["lr"] == 3e-3  # a rate given is used as given
    assert report["teacher"] == str(Path(tiny_model_dir).resolve()) and report["model"]["num_heads"] == 2


@pytest.mark.parametrize("case", ["ratio", "no_heads_left", "no_layers", "too_many_layers", "empty", "missing",
                                  "not_t5"])
def test_cli_bad_inputs_are_one_line_and_write_nothing(case, tiny_model_dir, demo_jsonl, tmp_path):
    model, data, extra = str(tiny_model_dir), str(demo_jsonl), []
    if case == "ratio":
        extra, needle = ["--ffn", "1.0"], "ffn: must be in [0, 1)"
    elif case == "no_heads_left":
        extra, needle = ["--heads", "0.9"], "removes all 4"
    elif case == "no_layers":
        extra, needle = ["--decoder-layers", "0"], "decoder_layers: must keep at least 1 layer"
    elif case == "too_many_layers":
        extra, needle = ["--encoder-layers", "3"], "the model has 2 encoder layers"
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text("\n")
        data, needle = str(tmp_path / "empty.jsonl"), "no examples"
    elif case == "missing":
        data, needle = str(tmp_path / "nope.jsonl"), "does not exist"
    else:
        (tmp_path / "bert").mkdir()
        (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
        model, needle = str(tmp_path / "bert"), "'bert' model"
    result = runner.invoke(app, ["prune", model, str(tmp_path / "out"), "--calib-data", data, *extra])
    assert result.exit_code != 0 and needle in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_recover_without_a_teacher_is_refused(tiny_model_dir, demo_jsonl, tmp_path):
    result = runner.invoke(app, ["recover", str(tiny_model_dir), str(tmp_path / "r"), "--data", str(demo_jsonl),
                                 "--distill"])
    assert result.exit_code != 0 and "pass --teacher" in result.output, result.output
    assert not (tmp_path / "r").exists()


def test_distillation_loss_is_cross_entropy_plus_kl_to_the_teacher(tiny_model_dir, tiny_gated_dir):
    from t5compress.train.distill import DistillConfig, distill_loss
    from t5compress.train.evaluation import token_loss

    student, batch = load_model(tiny_model_dir), _inputs()
    same = distill_loss(copy.deepcopy(student), DistillConfig(alpha=1.0, hidden_weight=1.0))
    assert float(same(student, batch)) == 0.0  # KL and hidden MSE to an identical teacher are exactly 0
    ce_only = distill_loss(copy.deepcopy(student), DistillConfig(alpha=0.0))
    assert torch.equal(ce_only(student, batch), token_loss(student, batch))
    teacher = load_model(tiny_gated_dir)
    loss = distill_loss(teacher, DistillConfig(alpha=0.5, temperature=2.0))(student, batch)
    assert float(loss) > 0.5 * float(token_loss(student, batch))
    loss.backward()
    assert student.shared.weight.grad is not None and all(p.grad is None for p in teacher.parameters())



def test_layerwise_distillation_matches_every_block_at_its_relative_depth(tiny_model_dir):
    from t5compress.train.distill import DistillConfig, distill_loss, layerwise_mse

    student, batch = load_model(tiny_model_dir), _inputs()
    kd = DistillConfig(alpha=1.0, hidden_weight=1.0, hidden_layers="all")
    assert float(distill_loss(copy.deepcopy(student), kd)(student, batch)) == 0.0
    s = tuple(torch.randn(2, 3, 4) for _ in range(3))  # embeddings + 2 blocks
    t = (s[0], torch.randn(2, 3, 4), s[1], torch.randn(2, 3, 4), s[2])  # embeddings + 4 blocks
    mask = torch.ones(2, 3)
    assert float(layerwise_mse(s, t, mask)) == 0.0  # student block j meets teacher block 2j+1
    mask[1, 2] = 0  # a padded position: differences there do not count
    t2 = tuple(x.clone() for x in t)
    t2[2][1, 2] += 5.0
    assert float(layerwise_mse(s, t2, mask)) == 0.0 and float(layerwise_mse(s, t2, torch.ones(2, 3))) > 0
    # Relative to the teacher's scale: the same error on a 10x larger stream weighs 100x less.
    a, b = (torch.zeros(1, 2, 4),) * 2, (torch.zeros(1, 2, 4), torch.ones(1, 2, 4))
    big = (torch.zeros(1, 2, 4), 10 * torch.ones(1, 2, 4))
    assert float(layerwise_mse(a, b, torch.ones(1, 2))) == pytest.approx(1.0)
    assert float(layerwise_mse((a[0], 9 * torch.ones(1, 2, 4)), big, torch.ones(1, 2))) == pytest.approx(0.01)
    with pytest.raises(ConfigError, match="hidden_layers"):
        DistillConfig(hidden_layers="some")

class _Killed(Exception):
    pass


def test_recovery_resumes_where_an_uninterrupted_run_ends(tiny_model_dir, demo_jsonl, tmp_path):
    from safetensors.torch import load_file

    from t5compress.train.loop import TrainConfig

    train = TrainConfig(max_steps=6, batch_size=8, lr=1e-3, eval_every=3, save_every=2, eval_max_examples=8,
                        metric="loss")
    cfg = _cfg(demo_jsonl, heads=0.5, ffn=0.25, latency_examples=0, eval_max_examples=8,
               recover=RecoverConfig(data=str(demo_jsonl), distill=True, train=train))
    run(str(tiny_model_dir), cfg, tmp_path / "clean", progress=False)

    def kill(state):
        if state["step"] == 5:
            raise _Killed()

    with pytest.raises(_Killed):
        run(str(tiny_model_dir), cfg, tmp_path / "resumed", progress=False, on_step=kill)
    assert (tmp_path / "resumed.partial" / "ckpt-0000004").is_dir() and not (tmp_path / "resumed").exists()
    report = run(str(tiny_model_dir), cfg, tmp_path / "resumed", progress=False, resume=True)
    assert report["recovery"]["train"]["resumed_from_step"] == 4
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("clean", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_recovery_stopped_while_its_loss_still_falls_says_so():
    falling = [{"step": 200, "loss": 3.80}, {"step": 400, "loss": 3.60}, {"step": 600, "loss": 3.50}]
    hint = still_improving(falling)
    assert hint and "3.6 at step 400, 3.5 at step 600" in hint and "--recover-steps" in hint
    assert still_improving(falling[:1]) is None  # one evaluation: no trend to read
    flat = falling[:2] + [{"step": 600, "loss": 3.59}]  # 0.3% lower: within the 1% it takes
    assert still_improving(flat) is None
    assert still_improving(falling[:2] + [{"step": 600, "loss": 3.70}]) is None  # rising again: long enough
    assert still_improving([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 3.5}, {"step": 3, "loss": 3.2}]) is None


def test_cli_recovery_reports_whether_it_stopped_short(tiny_model_dir, demo_jsonl, tmp_path, caplog):
    """Four steps at a high rate on a freshly pruned model: the held-out loss is still falling at the end (measured
    here 5.81 at step 2, 5.73 at step 4, 1.5% lower), so the report and the log say more steps may win back more."""
    _ok(["prune", str(tiny_model_dir), str(tmp_path / "p"), "--calib-data", str(demo_jsonl), "--heads", "0.5",
         "--ffn", "0.5", "--calib-examples", "32", "--eval-max-examples", "8", "--latency-examples", "0"])
    _ok(["recover", str(tmp_path / "p"), str(tmp_path / "r"), "--data", str(demo_jsonl), "--steps", "4",
         "--eval-every", "2", "--batch-size", "8", "--lr", "1e-2"])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    (s0, l0), (s1, l1) = [(h["step"], h["loss"]) for h in report["train"]["history"]]
    assert (s0, s1) == (2, 4) and l1 < 0.99 * l0, (l0, l1)
    assert report["still_improving"] and "at step 4): more steps may win back more" in report["still_improving"]
    assert any(r.getMessage() == report["still_improving"] for r in caplog.records)
