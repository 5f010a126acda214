"""Scoring functions: pure, each maps (prediction, answers, meta) to a score in [0, 1].

``meta`` carries what a metric needs besides the answers (e.g. a classification task's ``all_classes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any


@cache
def _rouge1_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """ROUGE-1 F-measure (rouge-score, Porter stemming), best over the answers."""
    scorer = _rouge1_scorer()
    return max(scorer.score(answer, prediction)["rouge1"].fmeasure for answer in answers)


Metric = Callable[[str, list[str], Mapping[str, Any]], float]
METRICS: dict[str, Metric] = {"rouge1": rouge1}
