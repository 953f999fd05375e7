"""The text-to-text data layer: reading files and datasets, clear errors on bad data, splits, tokens, batches."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from t5compress.data import DataConfig, Encoded, Example, batch_order, collate, encode, load_examples, load_splits
from t5compress.errors import ConfigError, DataError
from t5compress.model.tokenization import byte_level

FIELDS = DataConfig(source_field="document", target_field="summary")


@pytest.fixture(scope="module")
def tok():
    return byte_level()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep the arrow cache `datasets.load_dataset` writes for local files inside the test's directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def data_error(src, cfg: DataConfig | None = None, split: str | None = None) -> str:
    with pytest.raises(DataError) as info:
        load_examples(src, cfg or DataConfig(), split)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------------------------------------- reading


def test_jsonl_with_custom_fields_skips_blank_lines_and_keeps_text_as_is(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"document": "long text one", "summary": "one", "extra": 1}, "", "   ",
        {"document": "  ünïcode  ", "summary": ""},
    ])
    got = load_examples(path, DataConfig(source_field="document", target_field="summary", prefix="summarize: "))
    assert got == [Example("long text one", "one"), Example("  ünïcode  ", "")]  # the prefix is applied by encode


def test_json_array_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"document": "a", "summary": "b"}, {"document": "c", "summary": "d"}], indent=2))
    assert load_examples(path, FIELDS) == [Example("a", "b"), Example("c", "d")]
    path.write_text('[{"document": "a", "summary": 3}]')
    assert f"{path}: record 1: field 'summary' is a number, not a string" in data_error(path, FIELDS)


@pytest.mark.parametrize("ext,delim", [(".csv", ","), (".tsv", "\t")])
def test_csv_and_tsv_with_header_and_quoted_fields(tmp_path, ext, delim):
    path = tmp_path / f"train{ext}"
    path.write_text(f'id{delim}document{delim}summary\n1{delim}"a, b\tc"{delim}x\n\n2{delim}"two\nlines"{delim}y\n')
    assert load_examples(path, FIELDS) == [Example("a, b\tc", "x"), Example("two\nlines", "y")]


def test_csv_delimiter_override(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("document;summary\nhello, world;hi\n")
    assert load_examples(path, DataConfig(source_field="document", target_field="summary", delimiter=";")) == [
        Example("hello, world", "hi")
    ]


def test_saved_datasets_directory_with_splits(tmp_path):
    import datasets

    splits = {
        "train": datasets.Dataset.from_dict({"document": ["a", "b", "c"], "summary": ["1", "2", "3"]}),
        "validation": datasets.Dataset.from_dict({"document": ["v"], "summary": ["w"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "saved")
    assert [e.source for e in load_examples(tmp_path / "saved", FIELDS)] == ["a", "b", "c"]
    assert load_examples(tmp_path / "saved", FIELDS, split="validation") == [Example("v", "w")]
    assert "no split 'test'; its splits: train, validation" in data_error(tmp_path / "saved", FIELDS, "test")

    train, evals, stats = load_splits(tmp_path / "saved", None, DataConfig(**_fields(), hf_eval_split="validation"))
    assert (len(train), evals, stats["eval_from"], stats["eval_split"]) == (3, [Example("v", "w")], "hf_eval_split",
                                                                             "validation")


def test_directory_of_data_files_loaded_by_datasets(tmp_path, hf_cache):
    data = tmp_path / "corpus"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"document": f"d{i}", "summary": f"s{i}"} for i in range(4)])
    write_jsonl(data / "validation.jsonl", [{"document": "vd", "summary": "vs"}])
    assert [e.target for e in load_examples(data, FIELDS)] == ["s0", "s1", "s2", "s3"]
    assert load_examples(data, FIELDS, split="validation") == [Example("vd", "vs")]
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl(bad / "train.jsonl", [{"document": "vd", "label": "vs"}, {"document": "vd", "label": 3}])
    assert f"{bad} [train]: missing field 'summary' (fields: document, label)" in data_error(bad, FIELDS)
    assert f"{bad} [train] row 1: field 'label' is a number" in data_error(bad, DataConfig(target_field="label",
                                                                                       source_field="document"))


def _fields() -> dict:
    return {"source_field": "document", "target_field": "summary"}


# ---------------------------------------------------------------------------------------------------- bad data


@pytest.mark.parametrize("lines,cfg,expected", [
    (['{"source": "a", "target": "b"}', '{"source": "a" "target": "b"}'], DataConfig(),
     ":2: invalid JSON (Expecting ',' delimiter)"),
    (['{"source": "a", "target": "b"}', "", '{"source": "a", "label": "b"}'], DataConfig(),
     ":3: missing field 'target' (fields: source, label); set --source-field/--target-field"),
    (['{"source": null, "target": "b"}'], DataConfig(), ":1: field 'source' is null, not a string"),
    (['{"source": "a", "target": ["b"]}'], DataConfig(), ":1: field 'target' is an array, not a string"),
    (['["a", "b"]'], DataConfig(), ":1: expected an object with fields 'source' and 'target', got an array"),
    (['{"source": "ok", "target": "b"}', '{"source": "  ", "target": "b"}'], DataConfig(), ":2: source is empty"),
    (['{"source": "ok", "target": "b"}'] * 4 + ['{"source": "summarize:", "target": "b"}'],
     DataConfig(prefix="summarize: "), ":5: source is empty after the prefix 'summarize: '"),
    (['{"text": "a", "target": "b"}'], DataConfig(source_field="text", target_field="tgt"),
     ":1: missing field 'tgt' (fields: text, target)"),
])
def test_bad_jsonl_names_file_line_and_field(tmp_path, lines, cfg, expected):
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    assert f"{path}{expected}" in data_error(path, cfg)


def test_bad_bytes_name_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"source": "a", "target": "b"}\n{"source": "\xff", "target": "b"}\n')
    assert f"{path}:2: not UTF-8 text" in data_error(path)


@pytest.mark.parametrize("text,expected", [
    ("source,label\na,b\n", ":1: missing field 'target' (fields: source, label)"),
    ("source,target\na,b\nc\n", ":3: 1 columns, but the header has 2"),
    ("source,target\na,b\nc,d,e\n", ":3: 3 columns, but the header has 2"),
    ("source,target\n,b\n", ":2: source is empty"),
])
def test_bad_csv_names_file_line_and_field(tmp_path, text, expected):
    path = tmp_path / "train.csv"
    path.write_text(text)
    assert f"{path}{expected}" in data_error(path)


@pytest.mark.parametrize("name,content", [
    ("train.jsonl", "\n\n"), ("train.csv", ""), ("train.tsv", "source\ttarget\n"),
])
def test_empty_data_is_an_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    assert data_error(path) == f"{path}: no examples"


def test_missing_file_unknown_extension_and_split_of_a_file(tmp_path):
    assert data_error(tmp_path / "nope.jsonl") == f"data file '{tmp_path / 'nope.jsonl'}' does not exist"
    (tmp_path / "train.txt").write_text("hello\n")
    assert "unknown data format '.txt'; use one of .csv, .json, .jsonl, .tsv" in data_error(tmp_path / "train.txt")
    path = write_jsonl(tmp_path / "train.jsonl", [{"source": "a", "target": "b"}])
    assert "has a single split; it has no split 'validation'" in data_error(path, split="validation")


def test_dataset_name_without_network_fails_with_one_line():
    # conftest sets HF_DATASETS_OFFLINE=1; without it, no network fails the same way (checked before any request).
    msg = data_error("t5compress-test/no-such-dataset")
    assert msg.startswith("'t5compress-test/no-such-dataset' is not a local file or directory")


def test_config_rejects_bad_values_naming_the_field():
    for kwargs, field in [({"eval_fraction": 1.0}, "eval_fraction"), ({"max_source_length": 0}, "max_source_length"),
                          ({"delimiter": ";;"}, "delimiter"), ({"source_field": ""}, "source_field")]:
        with pytest.raises(ConfigError, match=f"^{field}: "):
            DataConfig(**kwargs)


# ---------------------------------------------------------------------------------------------------- splits


def test_held_out_split_is_deterministic_disjoint_and_complete(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"source": f"s{i}", "target": f"t{i}"} for i in range(25)])
    cfg = DataConfig(eval_fraction=0.2, split_seed=3)
    train, evals, stats = load_splits(path, None, cfg)
    assert (len(train), len(evals)) == (20, 5)
    assert {e.source for e in train} | {e.source for e in evals} == {f"s{i}" for i in range(25)}
    assert not {e.source for e in train} & {e.source for e in evals}
    assert load_splits(path, None, cfg)[1] == evals
    assert load_splits(path, None, DataConfig(eval_fraction=0.2, split_seed=4))[1] != evals
    assert stats == {"train_source": str(path), "eval_from": "held_out", "eval_source": str(path),
                     "eval_fraction": 0.2, "split_seed": 3, "train_examples": 20, "eval_examples": 5}
    assert [int(e.source[1:]) for e in train] == sorted(int(e.source[1:]) for e in train)  # file order kept


def test_held_out_split_keeps_one_example_each_side(tmp_path):
    two = write_jsonl(tmp_path / "two.jsonl", [{"source": "a", "target": "b"}, {"source": "c", "target": "d"}])
    train, evals, _ = load_splits(two, None, DataConfig(eval_fraction=0.01))
    assert (len(train), len(evals)) == (1, 1)
    one = write_jsonl(tmp_path / "one.jsonl", [{"source": "a", "target": "b"}])
    with pytest.raises(DataError, match="need at least 2 to hold out an eval split"):
        load_splits(one, None, DataConfig())


def test_eval_file_is_used_as_given(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"source": f"s{i}", "target": "t"} for i in range(3)])
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"source": "e", "target": "t"}])
    tr, ev, stats = load_splits(train, evals, DataConfig())
    assert (len(tr), ev, stats["eval_from"], stats["eval_examples"]) == (3, [Example("e", "t")], "eval_data", 1)
    with pytest.raises(DataError, match="the eval data is the training data"):
        load_splits(train, train, DataConfig())


# ---------------------------------------------------------------------------------------------------- tokens


def test_encode_applies_prefix_truncates_and_keeps_eos(tok, caplog):
    examples = [Example("abc", "xy"), Example("abcdefgh", "wxyz12"), Example("a", "")]
    cfg = DataConfig(prefix="p: ", max_source_length=6, max_target_length=5)
    with caplog.at_level("WARNING", logger="t5compress.data"):
        enc = encode(examples, tok, cfg)
    byte = [c + 3 for c in b"p: abc"]  # the byte tokenizer's id is byte + 3; </s> is 1
    assert enc.input_ids == [byte[:5] + [1], byte[:5] + [1], byte[:4] + [1]]
    assert enc.labels == [[ord("x") + 3, ord("y") + 3, 1], [c + 3 for c in b"wxyz"] + [1], [1]]
    assert enc.stats == {"examples": 3, "truncated_sources": 2, "truncated_targets": 1, "max_source_tokens": 12,
                         "max_target_tokens": 7, "mean_source_tokens": 8.0, "mean_target_tokens": 3.67}
    assert "2 of 3 sources are longer than max_source_length=6" in caplog.text
    assert "1 of 3 targets are longer than max_target_length=5" in caplog.text


def test_encode_nothing(tok):
    assert encode([], tok, DataConfig()).stats["examples"] == 0


# ---------------------------------------------------------------------------------------------------- batches


def _padding(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)


@pytest.mark.parametrize("bucket", [True, False])
def test_batch_order_covers_every_index_once_and_is_deterministic(bucket):
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(1003)]
    batches = batch_order(lengths, 16, seed=7, epoch=0, bucket=bucket)
    assert sorted(i for b in batches for i in b) == list(range(1003))
    assert sorted(len(b) for b in batches) == [11] + [16] * 62  # one partial batch kept
    assert batch_order(lengths, 16, seed=7, epoch=0, bucket=bucket) == batches
    assert batch_order(lengths, 16, seed=7, epoch=1, bucket=bucket) != batches
    assert batch_order(lengths, 16, seed=8, epoch=0, bucket=bucket) != batches


def test_bucketing_cuts_padding():
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(2000)]
    bucketed = _padding(batch_order(lengths, 16, seed=0, epoch=0), lengths)
    plain = _padding(batch_order(lengths, 16, seed=0, epoch=0, bucket=False), lengths)
    assert plain > 150_000  # ~ 2000 * (max - mean) of 16 uniform draws, about 2000 * 88
    assert bucketed < plain / 20


def test_batch_order_without_shuffle():
    lengths = [3, 9, 1, 9, 5]
    assert batch_order(lengths, 2, seed=0, epoch=0, bucket=False, shuffle=False) == [[0, 1], [2, 3], [4]]
    assert batch_order(lengths, 2, seed=5, epoch=3, bucket=True, shuffle=False) == [[1, 3], [4, 0], [2]]


def test_collate_pads_inputs_with_pad_id_and_labels_with_ignore_index():
    enc = Encoded(input_ids=[[5, 6, 1], [7, 1], [8, 9, 10, 11, 1]], labels=[[4, 1], [3, 3, 3, 1], [1]], stats={})
    batch = collate(enc, [1, 0], pad_id=0)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].tolist() == [[7, 1, 0], [5, 6, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[3, 3, 3, 1], [4, 1, -100, -100]]
    assert collate(enc, [2], pad_id=0)["input_ids"].shape == (1, 5)
