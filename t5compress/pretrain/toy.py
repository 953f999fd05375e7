"""A small generated corpus (no download): prose about the demo task's words and digits, for tests and benchmarks.

Each document is a few sentences that spell numbers digit by digit, list words, and sort them, so a tiny T5 can learn
something real from span corruption in minutes on two CPU cores, and that knowledge transfers to `t5compress.demo`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from t5compress.tasks import DIGITS, WORDS

_TEMPLATES = (
    "the number {num} is spelled {spelled} .",
    "written in order , the digits of {num} are {sorted_digits} .",
    "we saw a {w1} {w2} near the {w3} .",
    "the words {words} become {sorted_words} when sorted .",
    "in order : {sorted_words} .",
    "{num} has the digits {spelled} , and sorted they read {sorted_digits} .",
)


def toy_documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents of 2 to 5 sentences, deterministic in `seed`."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            digits = rng.sample(range(10), rng.randint(2, 7))
            words = rng.sample(WORDS, rng.randint(2, 6))
            w1, w2, w3 = rng.sample(WORDS, 3)
            sentences.append(rng.choice(_TEMPLATES).format(
                num="".join(map(str, digits)), spelled=" ".join(DIGITS[d] for d in digits),
                sorted_digits=" ".join(DIGITS[d] for d in sorted(digits)), words=" ".join(words),
                sorted_words=" ".join(sorted(words)), w1=w1, w2=w2, w3=w3))
        docs.append(" ".join(sentences))
    return docs


def write_toy_corpus(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` toy documents as JSON Lines with a `text` field."""
    path = Path(path)
    with open(path, "w") as f:
        for doc in toy_documents(n, seed):
            f.write(json.dumps({"text": doc}) + "\n")
    return path
