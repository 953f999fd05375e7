"""What every variant is fed: latency inputs of exactly `input_tokens` tokens, and the accuracy run's inputs.

Both are tokenized once, in the parent, with the tokenizer of the first variant that has one, and handed to every
worker as ids, so every engine sees the same tokens. Latency rows are cut from the eval texts (their token stream,
concatenated, cut into rows of input_tokens - 1 tokens plus EOS); without --data from generated sentences, which are
then also the accuracy run's inputs (agreement only: there are no references).
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
