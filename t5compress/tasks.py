"""The demo's generated text-to-text tasks (no download), for the quickstart recipe, tests and the toy corpus.

Two problems with T5-style prefixes, small enough to learn in minutes on two CPU cores (both order their output by
content, which a tiny T5 with only relative positions learns much faster than copying in order):
    "spell sorted: 4071"          -> "zero one four seven"
    "sort words: red apple stone" -> "apple red stone"
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
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


_WORD = re.compile(r"^[A-Za-z][a-z]*[,;]?$")  # plain words (a comma or semicolon may follow): no code, no names


def docstring_sentences(limit: int | None = None, min_words: int = 5, max_words: int = 12) -> list[str]:
    """Human-written English sentences from the docstrings of this interpreter's standard library, offline.

    Sentences of `min_words` to `max_words` plain words (no identifiers, numbers or markup), first occurrence kept,
    in a fixed shuffled order; `limit` stops reading once that many are found. The set depends on the Python version
    (3.11.7 gives about 4,300).
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if not {"test", "tests", "site-packages"} & set(p.parts))
    seen: dict[str, None] = {}
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for s in re.split(r"(?<=[.!?])\s+", " ".join((ast.get_docstring(node) or "").split())):
                words = s.rstrip(".").split()
                if min_words <= len(words) <= max_words and all(_WORD.match(w) for w in words):
                    seen.setdefault(" ".join(words))
        if limit is not None and len(seen) >= limit:
            break
    out = list(seen)
    random.Random(0).shuffle(out)
    return out


def word_order_examples(sentences: list[str], seed: int) -> list[dict[str, str]]:
    """"restore order: <the words shuffled>" -> the sentence: needs knowledge of English, so a small T5 reaches
    real but imperfect skill (a copy of the input already shares about half its longest common subsequence)."""
    rng = random.Random(seed)
    out = []
    for s in sentences:
        words = s.split()
        shuffled = words[:]
        while len(set(words)) > 1 and shuffled == words:
            rng.shuffle(shuffled)
        out.append({"source": "restore order: " + " ".join(shuffled), "target": s})
    return out
