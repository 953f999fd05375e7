"""What every variant is fed: latency inputs of exactly `input_tokens` tokens, and the accuracy run's inputs.

Both are tokenized once, in the parent, with the tokenizer of the first variant that has one, and handed to every
worker as ids, so every engine sees the same tokens. Latency rows are cut from the eval texts (their token stream,
concatenated, cut into rows of input_tokens - 1 tokens plus EOS); without --data from generated sentences, which are
then also the accuracy run's inputs (agreement only: there are no references).

A variant whose tokenizer.json has another vocabulary (`prune --vocab` trimmed it) gets the same pieces under its own
ids (`VocabMap`: piece by piece; a piece it lacks becomes its <unk>, counted), and its outputs are decoded with its
own tokenizer, so every engine still sees the same text as the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t5compress.bench.config import BenchConfig
from t5compress.errors import DataError, ModelError

SUBJECTS = ["the committee", "a small startup", "the river", "our neighbour", "the new policy", "the old bridge",
            "a local farmer", "the orchestra", "the research team", "the city council", "my sister", "the museum"]
VERBS = ["announced", "rejected", "described", "welcomed", "postponed", "explained", "repaired", "questioned"]
OBJECTS = ["a plan to reduce traffic", "the results of the survey", "a festival in the spring",
           "the cost of the repairs", "a proposal for cheaper trains", "the history of the valley",
           "an exhibition of modern paintings", "the decision to close the school"]
TASKS = ["translate English to German: ", "summarize: ", "translate English to French: ", ""]
GENERATED_EVAL = 32  # generated texts in the accuracy run without --data


def generated_texts(n: int, seed: int = 0) -> list[str]:
    """n plausible, varied sentences with T5 task prefixes (also the calibration texts of the goals benchmark)."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    texts = []
    for i in range(n):
        text = f"{pick(TASKS)}{pick(SUBJECTS).capitalize()} {pick(VERBS)} {pick(OBJECTS)}"
        if i % 3 == 0:
            text += f" after {pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)}"
        texts.append(text + ".")
    return texts


@dataclass
class Inputs:
    texts: list[str]  # accuracy inputs (prefix applied)
    references: list[str] | None  # None without --data
    eval_ids: np.ndarray  # (n, longest) right-padded
    eval_mask: np.ndarray
    latency_ids: np.ndarray  # (max batch, input_tokens), every row exactly input_tokens real tokens
    latency_mask: np.ndarray
    eos: tuple[int, ...]
    pad: int
    tokenizer_dir: Path
    source: str  # where the texts came from

    def save(self, path: Path) -> None:
        np.savez(path, latency_ids=self.latency_ids, latency_mask=self.latency_mask, eval_ids=self.eval_ids,
                 eval_mask=self.eval_mask)


def read_texts(cfg: BenchConfig) -> tuple[list[str], list[str] | None, str]:
    if not cfg.data:
        return generated_texts(min(cfg.eval_max, GENERATED_EVAL), cfg.seed), None, "generated sentences"
    from t5compress.data import DataConfig, load_examples

    examples = load_examples(cfg.data, DataConfig(source_field=cfg.field, target_field=cfg.target_field))
    examples = examples[: cfg.eval_max]
    return [cfg.prefix + e.source for e in examples], [e.target for e in examples], str(cfg.data)


def latency_rows(rows: list[list[int]], eos: tuple[int, ...], width: int, count: int) -> np.ndarray:
    """`count` rows of exactly `width` tokens: the texts' tokens (EOS dropped) as one stream, cut, EOS last."""
    stream = [t for r in rows for t in r if t not in eos]
    if not stream:
        raise DataError("the latency texts tokenize to no tokens")
    need = count * (width - 1)
    stream = (stream * (need // len(stream) + 1))[:need]  # too short a text: it is repeated
    ids = np.asarray(stream, dtype=np.int64).reshape(count, width - 1)
    return np.concatenate([ids, np.full((count, 1), eos[0], dtype=np.int64)], axis=1)  # (count, width)


def build(cfg: BenchConfig, dirs: list[Path]) -> Inputs:
    """Tokenize the texts with the first of `dirs` that has a tokenizer; ids for latency and accuracy."""
    from t5compress.runtime.settings import read_generation_defaults
    from t5compress.runtime.text import encode_batch, input_limit, load_text_tokenizer

    tok, where = None, None
    for d in dirs:
        try:
            tok, where = load_text_tokenizer(d), d
            break
        except ModelError:
            continue
    if tok is None:
        raise ModelError(f"no variant has a tokenizer (tokenizer.json or a byte-level tokenizer_config.json): "
                         f"{', '.join(map(str, dirs))}")
    special, _ = read_generation_defaults(where)
    texts, refs, source = read_texts(cfg)
    eos = special.eos or (1,)
    enc = encode_batch(tok, texts, input_limit(where), special.pad, eos)
    lat = latency_rows(tok.encode(texts), eos, cfg.input_tokens, max(cfg.batch_sizes))
    return Inputs(texts, refs, enc.input_ids, enc.attention_mask, lat, np.ones_like(lat), tuple(eos), special.pad,
                  where, source)


def decode(tok_dir: Path, rows: list[list[int]]) -> list[str]:
    from t5compress.runtime.text import load_text_tokenizer

    return [t.strip() for t in load_text_tokenizer(tok_dir).decode(rows)]


def vocabulary(path: Path) -> list[str | None] | None:
    """The pieces of the dir's tokenizer.json in id order (added tokens included); None without one."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    pieces: list[str | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for piece, i in vocab.items():
        pieces[i] = piece
    return pieces


@dataclass
class VocabMap:
    """The bench's ids (its tokenizer's: the reference) in a variant's own vocabulary, through the pieces."""

    to_variant: np.ndarray  # (reference pieces,) the variant's id of each reference id; its <unk> where it lacks one
    lacking: np.ndarray  # (reference pieces,) bool: the variant lacks this piece
    pieces: int  # the variant's vocabulary
    tokenizer_dir: Path  # where the variant's tokenizer is: its outputs are decoded with it

    def summary(self, inputs: Inputs) -> dict:
        """The variant's vocabulary size and how many input tokens it lacks (they reach it as <unk>)."""
        tokens = np.concatenate([inputs.latency_ids[inputs.latency_mask.astype(bool)],
                                 inputs.eval_ids[inputs.eval_mask.astype(bool)]])
        return {"pieces": self.pieces, "reference_pieces": len(self.to_variant), "input_tokens": int(tokens.size),
                "input_tokens_lacking": int(self.lacking[tokens].sum())}

    def save(self, inputs: Inputs, path: Path) -> tuple[int, ...]:
        """`inputs` in the variant's ids, saved as Inputs.save does; returns the EOS ids in its vocabulary."""
        t = self.to_variant
        np.savez(path, latency_ids=t[inputs.latency_ids], latency_mask=inputs.latency_mask,
                 eval_ids=t[inputs.eval_ids], eval_mask=inputs.eval_mask)
        return tuple(int(t[i]) for i in inputs.eos)


def vocab_map(reference: Path, variant: Path) -> VocabMap | None:
    """How ids of `reference`'s tokenizer map to `variant`'s; None when the vocabularies are the same (or either dir
    has no tokenizer.json: a byte-level vocabulary is never trimmed)."""
    ref, own = vocabulary(reference), vocabulary(variant)
    if ref is None or own is None or ref == own:
        return None
    index = {p: i for i, p in enumerate(own) if p is not None}
    unk = index.get("<unk>", 0)
    lacking = np.array([p not in index for p in ref], dtype=bool)
    to_variant = np.array([index.get(p, unk) for p in ref], dtype=np.int64)
    return VocabMap(to_variant, lacking, len(own), variant)
