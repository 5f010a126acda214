"""Scoring functions: pure, each maps (prediction, answers) to a score in [0, 1]."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache


@cache
def _rouge1_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1(prediction: str, answers: list[str]) -> float:
    """ROUGE-1 F-measure (rouge-score, Porter stemming), best over the answers."""
    scorer = _rouge1_scorer()
    return max(scorer.score(answer, prediction)["rouge1"].fmeasure for answer in answers)


METRICS: dict[str, Callable[[str, list[str]], float]] = {"rouge1": rouge1}
