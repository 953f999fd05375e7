"""Text-to-text data: read (source, target) records, hold out an eval split, tokenize, and batch by length.

Sources `load_examples` reads:
- JSON Lines (`.jsonl`, `.json`): one object per line, blank lines skipped; a `.json` file that starts with `[`
  is read as one JSON array of objects.
- CSV / TSV (`.csv`, `.tsv`) with a header row; `DataConfig.delimiter` overrides the one the extension implies.
- A local directory `datasets` can load: a `save_to_disk` directory (a Dataset or a DatasetDict), or data files
  whose names give the splits (`train.jsonl`, `validation.csv`, ...), read with `datasets.load_dataset(dir)`.
- A Hugging Face dataset name, read with `datasets.load_dataset(name, split=...)`.

Any problem with the data raises one-line DataError naming the file and line (or the split and row) and the field.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from t5compress.config import option, require
from t5compress.errors import DataError, ModelError, first_line, hub_reachable
from t5compress.textio import numbered_lines, read_text

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label value the cross-entropy loss skips
BUCKET_BATCHES = 50  # batches per length-sorted chunk: batches are near-uniform in length yet still vary per epoch
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # what a Hub dataset name can look like
_FIELD_HINT = "set --source-field/--target-field"

Record = tuple[str, Any]  # (where, raw record): where is "file:line" or "name [split] row i"

@dataclass(frozen=True)
class DataConfig:
    source_field: str = option("source", help="Field (JSON key or CSV column) holding the input text.")
    target_field: str = option("target", help="Field (JSON key or CSV column) holding the expected output text.")
    prefix: str = option("", help="Task prefix prepended to every source, e.g. 'summarize: '.")
    max_source_length: int = option(512, help="Sources longer than this many tokens are truncated (</s> kept).")
    max_target_length: int = option(128, help="Targets longer than this many tokens are truncated (</s> kept).")
    eval_fraction: float = option(0.1, help="Share of the training data held out for evaluation when none is given.")
    split_seed: int = option(0, help="Seed of the held-out split.")
    delimiter: str | None = option(None, help="CSV/TSV delimiter; default: ',' for .csv, tab for .tsv.")
    hf_split: str = option("train", help="Split to read from a datasets directory or Hugging Face dataset.")
    hf_eval_split: str | None = option(None, help="Split used as eval data, e.g. 'validation'; default: held out.")
    hf_config: str | None = option(None, help="Configuration of a Hub dataset that has several, e.g. 'mrpc' of glue.")

    def __post_init__(self) -> None:
        require(bool(self.source_field), "source_field", "must not be empty")
        require(bool(self.target_field), "target_field", "must not be empty")
        require(self.max_source_length >= 1, "max_source_length", f"must be >= 1, got {self.max_source_length}")
        require(self.max_target_length >= 1, "max_target_length", f"must be >= 1, got {self.max_target_length}")
        require(0 < self.eval_fraction < 1, "eval_fraction", f"must be between 0 and 1, got {self.eval_fraction}")
        require(self.delimiter is None or len(self.delimiter) == 1, "delimiter",
                f"must be one character, got {self.delimiter!r}")
        require(bool(self.hf_split), "hf_split", "must not be empty")
        require(self.hf_eval_split is None or bool(self.hf_eval_split), "hf_eval_split", "must not be empty")


@dataclass(frozen=True)
class Example:
    source: str
    target: str


@dataclass
class Encoded:
    """Token ids per example, each ending in </s>; stats count tokens before truncation, </s> included."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    stats: dict


def load_examples(src: str | os.PathLike, cfg: DataConfig, split: str | None = None) -> list[Example]:
    """Read (source, target) examples from a file, a local `datasets` directory or a Hugging Face dataset name.

    Args:
        split: the split to read (default `cfg.hf_split`). A file or a single saved Dataset has only that split;
            asking it for another one is an error rather than silently returning the same data.
    The prefix is not applied here (see `encode`), but a source that is empty or only the prefix is rejected.
    """
    name, path = str(src), Path(src).expanduser()
    split = split or cfg.hf_split
    if path.is_file():
        _only_split(name, split, cfg)
        records = _reader(path)(path, name, cfg)
    elif path.is_dir():
        records = _read_dataset_dir(path, name, split, cfg)
    elif path.suffix.lower() in READERS or not _REPO_ID.match(name):
        raise DataError(f"data file '{name}' does not exist")
    else:
        records = _read_hub_dataset(name, split, cfg)
    examples = [_example(record, where, cfg) for where, record in records]
    if not examples:
        raise DataError(f"{name}: no examples")
    log.info("read %d examples from %s", len(examples), name)
    return examples


def _read_json(path: Path, name: str, cfg: DataConfig) -> Iterator[Record]:
    with open(path, "rb") as f:
        is_array = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    return _read_json_array(path, name) if is_array else _read_jsonl(path, name, cfg)


def _read_jsonl(path: Path, name: str, cfg: DataConfig) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, text in numbered_lines(f, name):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{name}:{lineno}: invalid JSON ({e.msg})") from None
            yield f"{name}:{lineno}", record


def _read_json_array(path: Path, name: str) -> Iterator[Record]:
    try:
        records = json.loads(read_text(path, "data file"))
    except json.JSONDecodeError as e:
        raise DataError(f"{name}:{e.lineno}: invalid JSON ({e.msg})") from None
    for i, record in enumerate(records, 1):
        yield f"{name}: record {i}", record


def _read_csv(path: Path, name: str, cfg: DataConfig) -> Iterator[Record]:
    delimiter = cfg.delimiter or {".tsv": "\t"}.get(path.suffix.lower(), ",")
    with io.StringIO(read_text(path, "data file"), newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        try:
            header = reader.fieldnames  # reads the header row
            if not header:
                return
            _check_fields(header, f"{name}:{reader.line_num}", cfg)
            for row in reader:
                where = f"{name}:{reader.line_num}"
                if None in row or None in row.values():  # DictReader's marks for too many / too few columns
                    columns = len(header) + len(row.get(None, [])) - sum(v is None for v in row.values())
                    raise DataError(f"{where}: {columns} columns, but the header has {len(header)}; "
                                    f"check the delimiter {delimiter!r} and the quoting")
                yield where, row
        except csv.Error as e:
            raise DataError(f"{name}:{reader.line_num}: {e}") from None


Reader = Callable[[Path, str, DataConfig], Iterator[Record]]
READERS: dict[str, Reader] = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".tsv": _read_csv}


def _reader(path: Path) -> Reader:
    try:
        return READERS[path.suffix.lower()]
    except KeyError:
        raise DataError(
            f"{path}: unknown data format {path.suffix or '(no extension)'!r}; use one of "
            f"{', '.join(sorted(READERS))}, a datasets directory or a Hugging Face dataset name"
        ) from None


def _only_split(name: str, split: str, cfg: DataConfig) -> None:
    if split != cfg.hf_split:
        raise DataError(f"{name} has a single split; it has no split {split!r}: give the eval data as its own "
                        "file (--eval-data) or drop --hf-eval-split")


def _read_dataset_dir(path: Path, name: str, split: str, cfg: DataConfig) -> Iterator[Record]:
    import datasets

    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # written by save_to_disk
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{name}: no split {split!r}; its splits: {', '.join(ds)}")
                ds = ds[split]
            else:
                _only_split(name, split, cfg)
        else:
            ds = datasets.load_dataset(str(path), split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        why = first_line(e) + (f" ({first_line(e.__cause__)})" if e.__cause__ else "")
        raise DataError(f"cannot load the dataset directory '{name}' (split {split!r}): {why}") from e
    return _dataset_records(ds, f"{name} [{split}]", cfg)


def _read_hub_dataset(name: str, split: str, cfg: DataConfig) -> Iterator[Record]:
    """Load a Hub dataset; with no network fail at once with one line, not after minutes of retries."""
    import datasets

    if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():
        raise DataError(f"'{name}' is not a local file or directory, and the Hugging Face Hub cannot be reached "
                        "to load it as a dataset (no network); pass a local file, or set HF_DATASETS_OFFLINE=1 "
                        "to use a cached copy")
    try:
        ds = datasets.load_dataset(name, cfg.hf_config, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DataError(f"'{name}' is not a local file or directory, and loading it as a Hugging Face dataset "
                        f"(split {split!r}) failed: {first_line(e)}") from e
    return _dataset_records(ds, f"{name} [{split}]", cfg)


def _dataset_records(ds: Any, where: str, cfg: DataConfig) -> Iterator[Record]:
    _check_fields(ds.column_names, where, cfg)
    sources, targets = ds[cfg.source_field], ds[cfg.target_field]  # whole columns: far faster than row dicts
    for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
        yield f"{where} row {i}", {cfg.source_field: source, cfg.target_field: target}


def _check_fields(fields: Iterable[Any], where: str, cfg: DataConfig) -> None:
    fields = list(fields)
    for field in (cfg.source_field, cfg.target_field):
        if field not in fields:
            have = ", ".join(str(f) for f in fields) or "none"
            raise DataError(f"{where}: missing field {field!r} (fields: {have}); {_FIELD_HINT}")


def _example(record: Any, where: str, cfg: DataConfig) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with fields {cfg.source_field!r} and {cfg.target_field!r}, "
                        f"got {_kind(record)}")
    _check_fields(record, where, cfg)
    for field in (cfg.source_field, cfg.target_field):
        if not isinstance(record[field], str):
            hint = "" if record[field] is None else f"; {_FIELD_HINT}"
            raise DataError(f"{where}: field {field!r} is {_kind(record[field])}, not a string{hint}")
    source, target = record[cfg.source_field], record[cfg.target_field]
    if not source.strip() or (cfg.prefix.strip() and source.strip() == cfg.prefix.strip()):
        raise DataError(f"{where}: source is empty" + (f" after the prefix {cfg.prefix!r}" if cfg.prefix else ""))
    return Example(source, target)


def _kind(value: Any) -> str:
    kinds = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "an array",
             dict: "an object", str: "a string"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def load_splits(
    train: str | os.PathLike, eval: str | os.PathLike | None, cfg: DataConfig
) -> tuple[list[Example], list[Example], dict]:
    """Training and eval examples, plus stats saying where the eval split came from.

    The eval data is, in order of preference: `eval` (read with `cfg.hf_eval_split`, else `cfg.hf_split`); the
    `cfg.hf_eval_split` split of `train`; a deterministic held-out share (`eval_fraction`, `split_seed`) of `train`.
    """
    train_ex = load_examples(train, cfg)
    stats: dict[str, Any] = {"train_source": str(train)}
    if eval is not None:
        split = cfg.hf_eval_split or cfg.hf_split
        if os.path.abspath(eval) == os.path.abspath(train) and split == cfg.hf_split:
            raise DataError(f"the eval data is the training data ('{train}', split {split!r}); give other "
                            "--eval-data, an --hf-eval-split, or neither to hold out part of the training data")
        eval_ex = load_examples(eval, cfg, split=split)
        stats.update(eval_from="eval_data", eval_source=str(eval), eval_split=split)
    elif cfg.hf_eval_split:
        eval_ex = load_examples(train, cfg, split=cfg.hf_eval_split)
        stats.update(eval_from="hf_eval_split", eval_source=str(train), eval_split=cfg.hf_eval_split)
    else:
        train_ex, eval_ex = _hold_out(train_ex, str(train), cfg)
        stats.update(eval_from="held_out", eval_source=str(train), eval_fraction=cfg.eval_fraction,
                     split_seed=cfg.split_seed)
    stats.update(train_examples=len(train_ex), eval_examples=len(eval_ex))
    log.info("data: %d training examples, %d eval examples (%s)", len(train_ex), len(eval_ex), stats["eval_from"])
    return train_ex, eval_ex, stats


def _hold_out(examples: list[Example], name: str, cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """Split off round(n * eval_fraction) examples (at least 1 each side); both sides keep the file order."""
    n = len(examples)
    if n < 2:
        raise DataError(f"{name}: {n} example; need at least 2 to hold out an eval split, or give --eval-data")
    n_eval = min(n - 1, max(1, round(n * cfg.eval_fraction)))
    order = list(range(n))
    random.Random(cfg.split_seed).shuffle(order)
    held = set(order[:n_eval])
    return [ex for i, ex in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def encode(examples: list[Example], tokenizer: Any, cfg: DataConfig) -> Encoded:
    """Tokenize `cfg.prefix + source` and target, truncating each to its max length while keeping the final </s>."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ModelError("the tokenizer has no end-of-sequence token (</s>); T5 needs one to end every sequence")
    sources = _tokenize(tokenizer, [cfg.prefix + ex.source for ex in examples])
    targets = _tokenize(tokenizer, [ex.target for ex in examples])
    input_ids, cut_sources = _truncate(sources, cfg.max_source_length, eos)
    labels, cut_targets = _truncate(targets, cfg.max_target_length, eos)
    src_lens, tgt_lens = [len(s) + 1 for s in sources], [len(t) + 1 for t in targets]  # + </s>
    n = len(examples)
    stats = {
        "examples": n,
        "truncated_sources": cut_sources,
        "truncated_targets": cut_targets,
        "max_source_tokens": max(src_lens, default=0),
        "max_target_tokens": max(tgt_lens, default=0),
        "mean_source_tokens": round(sum(src_lens) / n, 2) if n else 0.0,
        "mean_target_tokens": round(sum(tgt_lens) / n, 2) if n else 0.0,
    }
    for side, cut, limit, longest in (("sources", cut_sources, cfg.max_source_length, stats["max_source_tokens"]),
                                      ("targets", cut_targets, cfg.max_target_length, stats["max_target_tokens"])):
        if cut:
            log.warning("%d of %d %s are longer than max_%s_length=%d tokens and were truncated (longest: %d)",
                        cut, n, side, side[:-1], limit, longest)
    return Encoded(input_ids, labels, stats)


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    # No special tokens: </s> is appended after truncation, so it survives it whatever the tokenizer's template.
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _truncate(seqs: list[list[int]], max_len: int, eos: int) -> tuple[list[list[int]], int]:
    out, cut = [], 0
    for ids in seqs:
        if len(ids) + 1 > max_len:
            ids, cut = ids[: max_len - 1], cut + 1
        out.append([*ids, eos])
    return out, cut


def batch_order(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, bucket: bool = True, shuffle: bool = True
) -> list[list[int]]:
    """Batches of example indices; every index appears exactly once and the last batch may be partial.

    shuffle and bucket: shuffle (deterministic in seed and epoch), sort chunks of BUCKET_BATCHES * batch_size by
    length, cut them into batches and shuffle the batches, so each batch needs little padding. shuffle only: plain
    shuffled batches. Neither: sequential. bucket without shuffle (evaluation): sorted by length, longest first, so
    an out-of-memory shows up at once; callers restore the order from the indices.
    """
    require(batch_size >= 1, "batch_size", f"must be >= 1, got {batch_size}")
    n = len(lengths)
    if not shuffle:
        order = sorted(range(n), key=lambda i: -lengths[i]) if bucket else list(range(n))
        return _cut(order, batch_size)
    rng = random.Random(f"{seed}:{epoch}")  # a str seed hashes both numbers (sha512), stable across processes
    order = list(range(n))
    rng.shuffle(order)
    if not bucket:
        return _cut(order, batch_size)
    chunk = BUCKET_BATCHES * batch_size
    batches = []
    for start in range(0, n, chunk):
        batches.extend(_cut(sorted(order[start : start + chunk], key=lengths.__getitem__), batch_size))
    rng.shuffle(batches)
    return batches


def _cut(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def collate(encoded: Encoded, indices: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sequence: input_ids and attention_mask (B, S), labels (B, T) padded with -100."""
    import torch

    if not indices:
        raise ValueError("collate needs at least one example index")
    sources = [encoded.input_ids[i] for i in indices]
    targets = [encoded.labels[i] for i in indices]
    input_ids = torch.full((len(sources), max(map(len, sources))), pad_id, dtype=torch.long)  # (B, S)
    attention_mask = torch.zeros_like(input_ids)  # (B, S)
    labels = torch.full((len(targets), max(map(len, targets))), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for row, (src, tgt) in enumerate(zip(sources, targets, strict=True)):
        input_ids[row, : len(src)] = torch.tensor(src, dtype=torch.long)
        attention_mask[row, : len(src)] = 1
        labels[row, : len(tgt)] = torch.tensor(tgt, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
