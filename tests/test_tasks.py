"""The generated tasks: the human-text sentences from the stdlib's docstrings and the restore-word-order task."""

from __future__ import annotations

from t5compress.tasks import docstring_sentences, word_order_examples


def test_docstring_sentences_are_plain_words_and_the_same_every_time():
    first = docstring_sentences(limit=200)
    assert len(first) >= 200 and first == docstring_sentences(limit=200)
    assert len(set(first)) == len(first)
    for s in first:
        words = s.split()
        assert 5 <= len(words) <= 12 and all(w.rstrip(",;").isalpha() for w in words), s


def test_word_order_examples_shuffle_the_words_of_the_sentence():
    sentences = docstring_sentences(limit=100)
    rows = word_order_examples(sentences, seed=0)
    assert rows == word_order_examples(sentences, seed=0) and rows != word_order_examples(sentences, seed=1)
    for s, r in zip(sentences, rows, strict=True):
        shuffled = r["source"].removeprefix("restore order: ")
        assert r["target"] == s and sorted(shuffled.split()) == sorted(s.split())
        assert shuffled != s or len(set(s.split())) == 1
