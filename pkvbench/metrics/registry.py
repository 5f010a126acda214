"""The metrics a task's ``metric:`` can name: the built-in ones of ``pkvbench.metrics.functions``, then those of other
packages, registered through the Python entry point group ``pkvbench.metrics.functions`` (name = what a task's YAML says,
value = ``module:function``; the function maps ``(prediction, answers, meta)`` to a score in [0, 1])::

    [project.entry-points."pkvbench.metrics"]
    exact_words = "my_package.metrics:exact_words"

A metric is imported the first time a task naming it is read.
"""

from __future__ import annotations

from typing import Any

from pkvbench.errors import PkvError
from pkvbench.plugins import Registry

ENTRY_POINT_GROUP = "pkvbench.metrics"
# name → where its function lives, in the order error messages list them.
BUILTIN: dict[str, str] = {
    "rouge1": "pkvbench.metrics.functions:rouge1",
    "word_set_recall": "pkvbench.metrics.functions:word_set_recall",
    "string_match_all": "pkvbench.metrics.functions:string_match_all",
    "string_match_part": "pkvbench.metrics.functions:string_match_part",
    "line_sequence": "pkvbench.metrics.functions:line_sequence",
    "word_sequence": "pkvbench.metrics.functions:word_sequence",
    "gsm8k_number": "pkvbench.metrics.functions:gsm8k_number",
    "math_equivalence": "pkvbench.metrics.functions:math_equivalence",
    "qa_f1": "pkvbench.metrics.functions:longbench_qa_f1",
    "qa_f1_zh": "pkvbench.metrics.functions:longbench_qa_f1_zh",
    "rouge": "pkvbench.metrics.functions:longbench_rouge",
    "rouge_zh": "pkvbench.metrics.functions:longbench_rouge_zh",
    "classification": "pkvbench.metrics.functions:longbench_classification",
    "retrieval": "pkvbench.metrics.functions:longbench_retrieval",
    "retrieval_zh": "pkvbench.metrics.functions:longbench_retrieval_zh",
    "count": "pkvbench.metrics.functions:longbench_count",
    "code_sim": "pkvbench.metrics.functions:longbench_code_sim",
}


def _check_metric(name: str, metric: Any, where: str) -> None:
    if not callable(metric):
        raise PkvError(f"{where} is not a function (a metric maps prediction, answers, meta to a score)")


METRICS = Registry("metric", ENTRY_POINT_GROUP, BUILTIN, _check_metric)
