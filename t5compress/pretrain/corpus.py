"""Streaming a pre-training corpus: documents from text files, JSON Lines, folders or Hugging Face datasets.

Nothing is read into memory whole: documents are yielded one at a time, so a corpus larger than memory works.
- `.txt` / `.md` / `.text`: one document per non-empty line.
- `.jsonl` / `.json` (one object per line): the `text_field` of each record.
- A folder: every such file below it, in sorted path order (a `datasets` `save_to_disk` folder is read as a dataset).
- Anything else that is not a local path: a Hugging Face dataset name, read with `streaming=True`.
Held-out documents are every `holdout_every`-th one (deterministic), so training and evaluation never share text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from t5compress.errors import DataError, first_line, hub_reachable
from t5compress.textio import read_lines

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Corpus:
    """Where the documents come from and how to read them."""

    source: str
    text_field: str = "text"
    hf_split: str = "train"
    hf_config: str | None = None
    holdout_every: int = 50

    def documents(self) -> Iterator[str]:
        """Every non-empty document, in a fixed order; raises DataError on malformed input or an empty corpus."""
        found = False
        for text in _documents(self):
            if text.strip():
                found = True
                yield text
        if not found:
            raise DataError(f"{self.source}: the corpus has no text")

    def split(self, train: bool) -> Iterator[str]:
        """The training documents (train=True) or the held-out ones (every `holdout_every`-th document)."""
        for i, text in enumerate(self.documents()):
            if (i % self.holdout_every == self.holdout_every - 1) != train:
                yield text


def _documents(c: Corpus) -> Iterator[str]:
    path = Path(c.source).expanduser()
    if path.is_file():
        yield from _read_file(path, c)
    elif path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            yield from _read_saved_dataset(path, c)
            return
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSON_SUFFIXES)
        if not files:
            raise DataError(f"{c.source}: no text files in the folder (looked for "
                            f"{', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)})")
        for f in files:
            yield from _read_file(f, c)
    elif path.suffix.lower() in TEXT_SUFFIXES + JSON_SUFFIXES or c.source.startswith((".", "/", "~")):
        raise DataError(f"corpus '{c.source}' does not exist")
    else:
        yield from _read_hub_dataset(c)


def _read_file(path: Path, c: Corpus) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield from _read_text(path)
    elif suffix in JSON_SUFFIXES:
        yield from _read_jsonl(path, c.text_field)
    else:
        raise DataError(f"{path}: unknown corpus format {suffix or '(no extension)'!r}; use "
                        f"{', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)}, a folder of them or a dataset name")


def _read_text(path: Path) -> Iterator[str]:
    for _, line in read_lines(path, "corpus file"):
        if line.strip():
            yield line.strip()


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    for lineno, line in read_lines(path, "corpus file"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a JSON object per line ({first_line(e)})") from None
        if not isinstance(record, dict) or field not in record:
            have = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no field {field!r} (fields: {have or 'none'}); set --text-field")
        if not isinstance(record[field], str):
            raise DataError(f"{path}:{lineno}: field {field!r} is not a string")
        yield record[field]


def _read_saved_dataset(path: Path, c: Corpus) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the dataset folder '{path}': {first_line(e)}") from e
    if isinstance(ds, datasets.DatasetDict):
        if c.hf_split not in ds:
            raise DataError(f"{path}: no split {c.hf_split!r}; its splits: {', '.join(ds)}")
        ds = ds[c.hf_split]
    yield from _dataset_texts(ds, f"{path} [{c.hf_split}]", c.text_field)


def _read_hub_dataset(c: Corpus) -> Iterator[str]:
    import datasets

    if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():
        raise DataError(f"'{c.source}' is not a local file or folder, and the Hugging Face Hub cannot be reached to "
                        "stream it as a dataset (no network); pass a local corpus")
    try:
        ds = datasets.load_dataset(c.source, c.hf_config, split=c.hf_split, streaming=True)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DataError(f"'{c.source}' is not a local file or folder, and streaming it as a Hugging Face dataset "
                        f"failed: {first_line(e)}") from e
    yield from _dataset_texts(ds, f"{c.source} [{c.hf_split}]", c.text_field)


def _dataset_texts(ds, where: str, field: str) -> Iterator[str]:
    columns = ds.column_names
    if columns is not None and field not in columns:
        raise DataError(f"{where}: no field {field!r} (fields: {', '.join(columns) or 'none'}); set --text-field")
    for i, row in enumerate(ds):
        value = row.get(field)
        if not isinstance(value, str):
            raise DataError(f"{where} row {i}: field {field!r} is missing or not a string; set --text-field")
        yield value


def tokenized(texts: Iterator[str], tokenizer, chunk: int = 256) -> Iterator[list[int]]:
    """Token ids of each document followed by </s>, tokenized `chunk` documents at a time (the fast path)."""
    eos = tokenizer.eos_token_id
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            yield from (ids + [eos] for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
            batch = []
    if batch:
        yield from (ids + [eos] for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
