"""Vocabulary pruning: a unigram tokenizer trained on far more text than the demo task needs, trimmed to the task."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from t5compress.cli import app
from t5compress.errors import ConfigError, DataError, ModelError
from t5compress.model.load import load_model, load_tokenizer
from t5compress.prune import PruneConfig, run
from t5compress.prune.vocab import check_trimmable, mandatory_ids, pieces_used, plan_vocab, trim_vocab
from t5compress.tasks import make_examples
from tests.conftest import build_tiny_t5

torch.set_num_threads(1)
runner = CliRunner()
SYLLABLES = "ka lo mi ne ru ta shi po zen qua vex dor fil gim hup jor bel cat".split()
HELD_OUT = make_examples(40, seed=7)  # the demo task, other examples than the trimming data's
FAST = {"latency_examples": 0, "eval_max_examples": 8}


def _corpus() -> list[str]:
    """The demo task's text plus many made-up words: a vocabulary several times what the task uses."""
    rng = random.Random(0)
    words = [" ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(12))
             for _ in range(800)]
    return [f"{e['source']} {e['target']}" for e in make_examples(400, seed=5)] + words


@pytest.fixture(scope="module")
def unigram():
    from t5compress.model.tokenization import new_tokenizer

    return new_tokenizer("unigram", _corpus(), vocab_size=400)


@pytest.fixture(scope="module", params=["tied", "untied"])
def trimmed(request, unigram, demo_jsonl, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(model dir, its vocabulary-pruned copy, the report): tied relu, and untied gated-gelu (Flan-style)."""
    root = tmp_path_factory.mktemp(f"vocab-{request.param}")
    kind = {} if request.param == "tied" else {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
    src = build_tiny_t5(root / "model", seed=3, tokenizer=unigram, **kind)
    report = run(src, PruneConfig(vocab=str(demo_jsonl), **FAST), root / "out", progress=False)
    return src, root / "out", report


def _texts() -> list[str]:
    return [e["source"] for e in HELD_OUT] + [e["target"] for e in HELD_OUT]


def _kept_old_ids(old_tok, new_tok) -> list[int]:
    """The old id of every new id, matched by piece string (no t5compress bookkeeping involved)."""
    return old_tok.convert_tokens_to_ids(new_tok.convert_ids_to_tokens(list(range(len(new_tok)))))


def test_held_out_text_is_segmented_into_the_same_pieces(trimmed):
    src, out, report = trimmed
    old, new = load_tokenizer(src), load_tokenizer(out)
    assert len(new) < len(old) / 3
    for text in _texts():
        assert new.tokenize(text) == old.tokenize(text), text
        assert new.decode(new(text).input_ids, skip_special_tokens=True) == text
    assert report["vocab"]["segmentation_changed"]["changed"] == 0
    assert new.tokenize("qx zz!") == old.tokenize("qx zz!")  # made of single characters kept even if unused


@torch.no_grad()
def test_logits_equal_the_untrimmed_ones_at_kept_ids(trimmed):
    src, out, _ = trimmed
    old_tok, new_tok = load_tokenizer(src), load_tokenizer(out)
    old_m, new_m = load_model(src), load_model(out)
    kept = _kept_old_ids(old_tok, new_tok)
    sources, targets = [e["source"] for e in HELD_OUT[:6]], [e["target"] for e in HELD_OUT[:6]]

    def logits(tok, model) -> torch.Tensor:  # (batch, tgt_len, vocab)
        enc, labels = tok(sources, padding=True, return_tensors="pt"), tok(targets, padding=True, return_tensors="pt")
        return model(**enc, labels=labels.input_ids).logits

    expected, got = logits(old_tok, old_m)[..., kept], logits(new_tok, new_m)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@torch.no_grad()
def test_greedy_generation_decodes_to_the_same_text(trimmed):
    src, out, _ = trimmed
    old_tok, new_tok = load_tokenizer(src), load_tokenizer(out)
    old_m, new_m = load_model(src), load_model(out)
    removed = sorted(set(range(old_m.config.vocab_size)) - set(_kept_old_ids(old_tok, new_tok)))
    sources = [e["source"] for e in HELD_OUT[:8]]
    old_in, new_in = old_tok(sources, padding=True, return_tensors="pt"), new_tok(sources, padding=True,
                                                                                 return_tensors="pt")
    kw = {"max_new_tokens": 8, "do_sample": False, "num_beams": 1}
    # The untrimmed model restricted to the kept pieces is what the trimmed model is; a random tiny model's argmax
    # may land on a removed piece, which a trained one on its own task does not.
    old = old_tok.batch_decode(old_m.generate(**old_in, suppress_tokens=removed, **kw), skip_special_tokens=True)
    new = new_tok.batch_decode(new_m.generate(**new_in, **kw), skip_special_tokens=True)
    assert new == old
    assert any(old)


def test_the_dir_is_plain_hugging_face(trimmed):
    from transformers import AutoTokenizer, GenerationConfig, T5ForConditionalGeneration

    src, out, _ = trimmed
    model = T5ForConditionalGeneration.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(tok).__name__ == "T5TokenizerFast" and len(tok) == model.config.vocab_size
    assert not (out / "spiece.model").exists()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.decoder_start_token_id, gen.pad_token_id, gen.eos_token_id) == (0, 0, 1)
    assert json.loads((out / "tokenizer_config.json").read_text())["extra_ids"] == 0
    assert model.config.tie_word_embeddings == load_model(src).config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()


def test_peers_convert_the_trimmed_dir_and_generate_its_tokens(trimmed, tmp_path):
    """CTranslate2's converter and optimum's ONNX export load the trimmed dir as they would any T5 dir, and their
    greedy outputs are transformers' on it, token for token (CTranslate2 at float32, so the comparison is exact)."""
    import ctranslate2
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    _, out, _ = trimmed
    tok, model = load_tokenizer(out), load_model(out)
    sources = [e["source"] for e in HELD_OUT[:6]]
    kw = {"max_new_tokens": 8, "do_sample": False, "num_beams": 1}
    with torch.no_grad():
        ref = model.generate(**tok(sources, padding=True, return_tensors="pt"), **kw)

    def tokens(rows) -> list[list[int]]:  # without the start token; up to the first EOS, the padding after it dropped
        out = [row.tolist()[1:] for row in rows]
        return [r[:r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in out]

    ref = tokens(ref)

    ctranslate2.converters.TransformersConverter(str(out)).convert(str(tmp_path / "ct2"), quantization="float32")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    pieces = [tok.convert_ids_to_tokens(tok(s).input_ids) for s in sources]
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=8, return_end_token=True)
    assert [tok.convert_tokens_to_ids(r.hypotheses[0]) for r in results] == ref

    ort = ORTModelForSeq2SeqLM.from_pretrained(out, export=True)
    assert ort.config.vocab_size == model.config.vocab_size < load_model(trimmed[0]).config.vocab_size
    got = ort.generate(**tok(sources, padding=True, return_tensors="pt"), **kw)
    assert tokens(got) == ref
    assert any(len(r) > 1 for r in ref)


def test_sizes_shrink_and_the_report_says_by_how_much(trimmed):
    src, out, report = trimmed
    v = report["vocab"]
    assert v["before"]["pieces"] == 500 and v["after"]["pieces"] < 150
    assert v["after"]["parameters"] < v["before"]["parameters"]
    d = load_model(src).config.d_model
    rows = v["before"]["pieces"] - v["after"]["pieces"]
    untied = not load_model(src).config.tie_word_embeddings
    assert v["before"]["parameters"] - v["after"]["parameters"] == rows * d * (2 if untied else 1)
    assert (out / "model.safetensors").stat().st_size < (src / "model.safetensors").stat().st_size
    assert report["model"]["vocab_size"] == v["after"]["pieces"]


def test_export_quantize_and_generate_work_on_the_trimmed_dir(trimmed, tmp_path):
    from t5compress.export import ExportConfig
    from t5compress.export import run as export
    from t5compress.quantize import QuantizeConfig
    from t5compress.quantize import run as quantize
    from t5compress.runtime import load_runtime

    _, out, _ = trimmed
    rep = export(out, ExportConfig(), tmp_path / "onnx", progress=False)  # raises unless ONNX matches PyTorch
    assert rep["model"]["vocab_size"] < 150 and rep["parity"]
    quantize(tmp_path / "onnx", QuantizeConfig(mode="dynamic", min_agreement=0.0), tmp_path / "int8",
             progress=False)
    texts = [e["source"] for e in HELD_OUT[:4]]
    tok, model = load_tokenizer(out), load_model(out)
    with torch.no_grad():
        want = tok.batch_decode(model.generate(**tok(texts, padding=True, return_tensors="pt"), max_new_tokens=6,
                                               do_sample=False, num_beams=1), skip_special_tokens=True)
    got = load_runtime(tmp_path / "onnx").generate_text(texts, max_new_tokens=6)
    assert got == want
    assert len(load_runtime(tmp_path / "int8").generate_text(texts, max_new_tokens=6)) == 4


@pytest.mark.parametrize("trimmed", ["tied"], indirect=True)  # one bench per test run: the tied model covers it
def test_bench_feeds_a_trimmed_variant_its_own_ids_and_reads_its_outputs_back(trimmed, demo_jsonl, tmp_path):
    """Bench tokenizes once, with the first variant's tokenizer: the trimmed variant gets the same pieces under its own
    ids and its outputs are read back, so each variant's bench outputs are what it generates from the text with its
    own tokenizer; in either order, and beside the CTranslate2 peer converted from the untrimmed model."""
    from t5compress.bench import BenchConfig
    from t5compress.bench import run as bench

    src, out, _ = trimmed
    assert load_model(src).config.tie_word_embeddings
    cfg = BenchConfig(data=str(demo_jsonl), batch_sizes=(2,), input_tokens=8, output_tokens=6, repeats=1,
                      eval_max=8, max_new_tokens=8, plots=False, peers=("ctranslate2-int8",))
    for order, peers in ((("full", "trim"), cfg.peers), (("trim", "full"), ())):
        dirs = {"full": src, "trim": out}
        r = bench([f"{n}={dirs[n]}" for n in order], dataclasses.replace(cfg, peers=peers), tmp_path / order[0],
                  progress=False)
        e = {x["name"]: x for x in r["entries"]}
        assert not [n for n, x in e.items() if "error" in x]
        for name, d in dirs.items():  # what bench decoded is what the variant generates from the text by itself
            samples = e[name]["accuracy"]["samples"]
            tok, model = load_tokenizer(d), load_model(d)
            with torch.no_grad():
                ids = model.generate(**tok([x["input"] for x in samples], padding=True, return_tensors="pt"),
                                     max_new_tokens=8, do_sample=False, num_beams=1)
            assert [x["output"] for x in samples] == [t.strip() for t in tok.batch_decode(ids,
                                                                                       skip_special_tokens=True)]
        other = e[order[1]]
        assert other["vocabulary"]["input_tokens_lacking"] == 0 and "-piece vocabulary" in other["label"]
        assert "vocabulary" not in e[order[0]] and all(c["new_tokens_min"] == c["new_tokens_max"] == 6
                                                       for c in other["cells"])
    assert e["full"]["vocabulary"]["pieces"] == len(load_tokenizer(src)) > e["full"]["vocabulary"]["reference_pieces"]


def test_recovery_distils_from_the_untrimmed_model_trimmed_alike(trimmed, demo_jsonl, tmp_path):
    from t5compress.prune.recover import RecoverConfig
    from t5compress.prune.recover import run as recover
    from t5compress.train.loop import TrainConfig

    src, out, _ = trimmed
    train = TrainConfig(max_steps=2, batch_size=8, eval_every=2, eval_max_examples=8, metric="loss")
    rec = RecoverConfig(data=str(demo_jsonl), distill=True, train=train)
    if load_model(src).config.tie_word_embeddings:  # within prune: the in-memory teacher
        report = run(src, PruneConfig(vocab=str(demo_jsonl), recover=rec, **FAST), tmp_path / "rec", progress=False)
    else:  # on its own: the teacher is the parent dir, with the full vocabulary
        report = recover(out, rec, tmp_path / "rec", progress=False)
    assert report["model"]["vocab_size"] == load_model(out).config.vocab_size


def test_vocab_size_keeps_the_most_frequent_and_mandatory(unigram, demo_jsonl):
    from t5compress.data import DataConfig, load_examples

    counts = pieces_used(unigram, load_examples(demo_jsonl, DataConfig()))
    must = mandatory_ids(unigram, sentinels=True, keep_pieces=["▁kalo"] if "▁kalo" in unigram.get_vocab() else [])
    always = set().union(*must.values())
    keep = plan_vocab(unigram, counts, must, size=len(always) + 5)
    assert len(keep) == len(always) + 5 and always <= set(keep)
    chosen, dropped = set(keep) - always, set(range(len(unigram))) - set(keep)
    assert min(counts[i] for i in chosen) >= max(counts[i] for i in dropped) > 0  # the most frequent, ties aside
    with pytest.raises(ConfigError, match="vocab_size: 10 is fewer than"):
        plan_vocab(unigram, counts, must, size=10)


def test_trim_vocab_low_level_returns_the_id_map(unigram):
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=len(unigram), d_model=16, d_ff=32, d_kv=4, num_heads=2,
                                                num_layers=1, decoder_start_token_id=0, pad_token_id=0,
                                                eos_token_id=1))
    keep = [0, 1, 2, *range(10, 40)]
    model, tok, id_map = trim_vocab(model, unigram, keep)
    assert id_map[10] == 3 and len(tok) == model.config.vocab_size == len(keep)
    with pytest.raises(ConfigError, match=r"\(id 1\) must be kept"):
        trim_vocab(model, tok, [0, 2, 3])


def _one_line(e: BaseException) -> str:
    assert "\n" not in str(e)
    return str(e)


def test_bad_inputs_fail_in_one_line_and_write_nothing(trimmed, tiny_model_dir, demo_jsonl, tmp_path):
    src = trimmed[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    cases = [
        (tiny_model_dir, {"vocab": str(demo_jsonl)}, ModelError, "byte-level"),
        (src, {"vocab": str(empty)}, DataError, "no examples"),
        (src, {"vocab": str(tmp_path / "missing.jsonl")}, DataError, "does not exist"),
        (src, {"vocab": str(demo_jsonl), "vocab_size": 5}, ConfigError, "vocab_size: 5 is fewer than"),
        (src, {"vocab": str(demo_jsonl), "vocab_keep": str(tmp_path / "no.txt")}, DataError, "does not exist"),
    ]
    for model, kw, error, words in cases:
        with pytest.raises(error, match=words) as e:
            run(model, PruneConfig(**kw, **FAST), out, progress=False)
        _one_line(e.value)
        assert not out.exists()
    with pytest.raises(ConfigError, match="vocab_size: needs --vocab"):
        PruneConfig(calib_data=str(demo_jsonl), vocab_size=100)
    with pytest.raises(ConfigError, match="calib_data"):
        PruneConfig()


def test_cli_prunes_the_vocabulary_and_refuses_a_byte_tokenizer(trimmed, tiny_model_dir, demo_jsonl, tmp_path):
    src = trimmed[0]
    keep = tmp_path / "keep.txt"
    keep.write_text("<extra_id_0>\n")
    r = runner.invoke(app, ["prune", str(src), str(tmp_path / "out"), "--vocab", str(demo_jsonl), "--vocab-keep",
                            str(keep), "--latency-examples", "0", "--eval-max-examples", "8"])
    assert r.exit_code == 0, r.output
    assert "vocabulary: 500 →" in r.output and "(0.00%)" in r.output
    assert "<extra_id_0>" in load_tokenizer(tmp_path / "out").get_vocab()
    r = runner.invoke(app, ["info", str(tmp_path / "out")])
    assert r.exit_code == 0 and "vocab" in r.output
    r = runner.invoke(app, ["prune", str(tiny_model_dir), str(tmp_path / "bad"), "--vocab", str(demo_jsonl)])
    assert r.exit_code != 0 and "byte-level" in r.output and "Traceback" not in r.output
    assert check_trimmable(load_tokenizer(src)) is None


def test_a_dir_with_spiece_model_loses_it_and_keeps_its_segmentation(demo_jsonl, tmp_path):
    """Real T5 checkpoints carry spiece.model beside tokenizer.json (and add_prefix_space, which would rebuild the
    fast tokenizer from it): the trimmed dir drops it rather than ship a file of the old vocabulary."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer, T5Tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=300,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   hard_vocab_limit=False, minloglevel=2)
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "spiece.model").write_bytes(model.getvalue())
    T5Tokenizer(vocab_file=str(slow / "spiece.model"), legacy=False).save_pretrained(slow)
    src = build_tiny_t5(tmp_path / "model", tokenizer=AutoTokenizer.from_pretrained(slow))
    assert (src / "spiece.model").is_file() and (src / "tokenizer.json").is_file()
    run(src, PruneConfig(vocab=str(demo_jsonl), **FAST), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "spiece.model").exists()
    old, new = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(new) < len(old) / 2
    assert all(new.tokenize(t) == old.tokenize(t) for t in _texts())
