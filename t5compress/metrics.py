"""Text-to-text metrics from their reference implementations: exact match, ROUGE-L (rouge-score), BLEU (sacrebleu)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from t5compress.config import choose


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Percentage of predictions equal to their reference after stripping surrounding whitespace."""
    if not predictions:
        return 0.0
    return 100.0 * sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)) / len(predictions)


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F1 (rouge-score, with stemming), as a percentage."""
    from rouge_score import rouge_scorer

    if not predictions:
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)]
    return 100.0 * sum(scores) / len(scores)


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenisation, exponential smoothing)."""
    import sacrebleu

    if not predictions:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


METRICS: dict[str, Callable[[Sequence[str], Sequence[str]], float]] = {
    "exact_match": exact_match,
    "rougeL": rouge_l,
    "bleu": bleu,
}


def compute(predictions: Sequence[str], references: Sequence[str], names: Sequence[str] | None = None) -> dict:
    """All (or the named) metrics, each rounded to 2 decimals."""
    names = list(names or METRICS)
    return {n: round(choose(METRICS, n, "metric")(predictions, references), 2) for n in names}
