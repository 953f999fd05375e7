import pytest

from t5compress import metrics
from t5compress.errors import ConfigError


def test_metrics_on_known_values():
    preds, refs = ["four two", "red cat", "a b c"], ["four two", "cat red", "a b d"]
    m = metrics.compute(preds, refs)
    assert m["exact_match"] == pytest.approx(33.33, abs=0.01)
    # ROUGE-L F1: 1.0, 0.5 (LCS 1 of 2), 2/3
    assert m["rougeL"] == pytest.approx(100 * (1 + 0.5 + 2 / 3) / 3, abs=0.01)
    long_refs = ["one two three four five six", "seven eight nine ten eleven"]
    assert metrics.bleu(long_refs, long_refs) == pytest.approx(100.0)
    assert 0 < metrics.bleu(["one two three four five seven", "seven eight nine ten eleven"], long_refs) < 100


def test_unknown_metric_lists_valid_ones():
    with pytest.raises(ConfigError, match="bleu, exact_match, rougeL"):
        metrics.compute(["a"], ["a"], ["accuracy"])
