"""Text in and out of the runtime without transformers: a `tokenizer.json` through `tokenizers`, or ByT5's bytes.

Two tokenizers share one small interface (`encode(texts) -> id lists`, `decode(rows) -> strings`):
- `JsonTokenizer`: the `tokenizer.json` every fast tokenizer saves (SentencePiece T5s, the package's byte tokenizer).
- `ByteTokenizer`: ByT5 and other byte-level checkpoints, whose `ByT5Tokenizer` has no fast version and so no
  tokenizer.json: UTF-8 bytes shifted by the 3 special ids (pad 0, eos 1, unk 2), special tokens and sentinels
  (`<extra_id_N>`) from `tokenizer_config.json`, EOS appended, exactly as `transformers.ByT5Tokenizer`.

Inputs longer than the model's limit are truncated as transformers does with `truncation=True` (the first
`limit - 1` tokens, then the EOS), and `Encoded` says which ones were, and from how many tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from t5compress.errors import DataError, ModelError
from t5compress.textio import check_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_TOKENIZERS = ("ByT5Tokenizer",)  # tokenizer_class values the ByteTokenizer reproduces
UNLIMITED = 10**9  # transformers writes model_max_length = 1e30 for "no limit": anything this large means none


class TextTokenizer(Protocol):
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, special tokens (the trailing EOS) included, untruncated."""

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """Strings per row of ids, special tokens skipped."""


@dataclass(frozen=True)
class Encoded:
    """A tokenized, truncated, right-padded batch."""

    input_ids: np.ndarray  # (batch, longest) int64, padded with the pad id
    attention_mask: np.ndarray  # (batch, longest) int64, 1 for real tokens
    lengths: tuple[int, ...]  # tokens each input had before truncation (EOS included)
    limit: int | None  # the truncation length used (None: none)

    @property
    def truncated(self) -> tuple[bool, ...]:
        return tuple(self.limit is not None and n > self.limit for n in self.lengths)


class JsonTokenizer:
    """A `tokenizer.json` (any fast Hugging Face tokenizer), padding and truncation left to `encode_batch`."""

    def __init__(self, file: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
            raise ModelError(f"cannot read '{file}': {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return self.tokenizer.decode_batch([list(r) for r in rows], skip_special_tokens=True)


class ByteTokenizer:
    """ByT5's tokenizer: id = byte + 3; special tokens and sentinels by name; EOS appended unless already last."""

    OFFSET = 3  # pad, eos, unk come first

    def __init__(self, specials: dict[int, dict], eos: int = 1):
        """`specials`: id -> {"content", "lstrip", "rstrip"}, as `tokenizer_config.json`'s added_tokens_decoder."""
        self.eos = eos
        self.ids = {t["content"]: i for i, t in specials.items()}
        self.strip = {t["content"]: (bool(t.get("lstrip")), bool(t.get("rstrip"))) for t in specials.values()}
        self.special_ids = frozenset(specials)
        # Longest first, so '<extra_id_10>' is not read as '<extra_id_1>' + '0>'.
        names = sorted(self.ids, key=len, reverse=True)
        self.pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @classmethod
    def from_config(cls, config: dict) -> ByteTokenizer:
        added = config.get("added_tokens_decoder") or {}
        specials = {int(i): t for i, t in added.items()}
        if not specials:  # an old config without the table: ByT5's defaults
            specials = {0: {"content": "<pad>", "lstrip": True, "rstrip": True},
                        1: {"content": "</s>", "lstrip": True, "rstrip": True},
                        2: {"content": "<unk>", "lstrip": True, "rstrip": True}}
            extra = config.get("additional_special_tokens") or [f"<extra_id_{i}>" for i in range(125)]
            specials.update({259 + i: {"content": name} for i, name in enumerate(extra) if isinstance(name, str)})
        eos_name = config.get("eos_token") or "</s>"
        eos_name = eos_name.get("content", "</s>") if isinstance(eos_name, dict) else eos_name
        eos = next((i for i, t in specials.items() if t["content"] == eos_name), 1)
        return cls(specials, eos)

    def _pieces(self, text: str) -> list[str | int]:
        """Plain text segments and special-token ids, with the whitespace special tokens strip removed."""
        parts = self.pattern.split(text) if self.pattern else [text]
        out: list[str | int] = []
        for k, part in enumerate(parts):
            if k % 2:  # a special token
                lstrip, rstrip = self.strip[part]
                if lstrip and out and isinstance(out[-1], str):
                    out[-1] = out[-1].rstrip()
                if rstrip and k + 1 < len(parts):
                    parts[k + 1] = parts[k + 1].lstrip()
                out.append(self.ids[part])
            else:
                out.append(part)
        return out

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        rows = []
        for text in texts:
            ids: list[int] = []
            for piece in self._pieces(text):
                ids += [piece] if isinstance(piece, int) else [b + self.OFFSET for b in piece.encode("utf-8")]
            if not ids or ids[-1] != self.eos:
                ids.append(self.eos)
            rows.append(ids)
        return rows

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        out = []
        for row in rows:
            data = bytes(i - self.OFFSET for i in row if i not in self.special_ids and 0 <= i - self.OFFSET < 256)
            out.append(data.decode("utf-8", errors="ignore"))  # a cut multi-byte character is dropped, as ByT5
        return out


def read_tokenizer_config(path: Path) -> dict:
    file = path / TOKENIZER_CONFIG
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise ModelError(f"'{file}' is not valid JSON: {e}") from None


def load_text_tokenizer(path: Path) -> TextTokenizer:
    """The dir's `tokenizer.json`, else a byte-level tokenizer when `tokenizer_config.json` names one."""
    if (path / TOKENIZER_FILE).is_file():
        return JsonTokenizer(path / TOKENIZER_FILE)
    config = read_tokenizer_config(path)
    if config.get("tokenizer_class") in BYTE_TOKENIZERS:
        return ByteTokenizer.from_config(config)
    raise ModelError(
        f"'{path}' has no {TOKENIZER_FILE} (nor a byte-level tokenizer_config.json): text generation needs one "
        "(token ids work without)"
    )


def input_limit(path: Path) -> int | None:
    """`model_max_length` of the dir's tokenizer_config.json; None when absent or transformers' 'no limit'."""
    value = read_tokenizer_config(path).get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < UNLIMITED:
        return int(value)
    return None


def truncate(ids: list[int], limit: int | None, eos: Sequence[int]) -> list[int]:
    """The first `limit` tokens; an input that ended with EOS keeps it as its last token (transformers' rule)."""
    if limit is None or len(ids) <= limit:
        return ids
    if ids and ids[-1] in eos:
        return ids[: limit - 1] + ids[-1:]
    return ids[:limit]


def _check_texts(texts: Sequence[str]) -> None:
    """Strings that UTF-8 can encode, so that no tokenizer fails on them with a TypeError (the CLI's readers refuse
    them earlier, naming the file and line)."""
    for number, t in enumerate(texts, 1):
        if not isinstance(t, str):
            raise DataError(f"input {number} is {type(t).__name__}, not text")
        check_text(t, f"input {number}")


def encode_batch(tok: TextTokenizer, texts: Sequence[str], limit: int | None, pad: int,
                 eos: Sequence[int]) -> Encoded:
    """Tokenize, truncate to `limit` tokens (None or 0: no limit) and right-pad with `pad`."""
    if not texts:
        raise DataError("no input text given")
    if limit is not None and limit < 0:
        raise DataError(f"max_input_tokens must be >= 1 (or 0 for no limit), got {limit}")
    limit = limit or None
    _check_texts(texts)
    rows = tok.encode(texts)
    cut = [truncate(r, limit, eos) for r in rows]
    width = max(len(r) for r in cut)
    if width == 0:
        raise DataError("the input texts tokenize to no tokens at all")
    ids = np.full((len(cut), width), pad, dtype=np.int64)  # (batch, longest)
    mask = np.zeros((len(cut), width), dtype=np.int64)
    for i, r in enumerate(cut):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return Encoded(ids, mask, tuple(len(r) for r in rows), limit)
