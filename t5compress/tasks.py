"""The demo's generated text-to-text tasks (no download), for the quickstart recipe, tests and the toy corpus.

Two problems with T5-style prefixes, small enough to learn in minutes on two CPU cores (both order their output by
content, which a tiny T5 with only relative positions learns much faster than copying in order):
    "spell sorted: 4071"          -> "zero one four seven"
    "sort words: red apple stone" -> "apple red stone"
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DIGITS = "zero one two three four five six seven eight nine".split()
WORDS = (
    "red blue green apple stone river cloud tree bird fish light dark small large quick slow north south east west "
    "paper glass metal wood fire water earth wind moon sun star road house door window garden"
).split()


def make_examples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` examples of the two demo tasks, deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            digits = rng.sample(range(10), rng.randint(2, 7))
            out.append({"source": "spell sorted: " + "".join(map(str, digits)),
                        "target": " ".join(DIGITS[d] for d in sorted(digits))})
        else:
            words = rng.sample(WORDS, rng.randint(2, 6))
            out.append({"source": "sort words: " + " ".join(words), "target": " ".join(sorted(words))})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
