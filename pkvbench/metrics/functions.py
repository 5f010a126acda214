"""Scoring functions: pure, each maps (prediction, answers, meta) to a score in [0, 1].

``meta`` carries what a metric needs besides the answers (e.g. a classification task's ``all_classes``). A task's
``metric:`` names one through ``pkvbench.metrics.registry``.
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from difflib import SequenceMatcher
from functools import cache
from typing import Any

from pkvbench.errors import PkvError


@cache
def _rouge1_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """ROUGE-1 F-measure (rouge-score, Porter stemming), best over the answers."""
    scorer = _rouge1_scorer()
    return max(scorer.score(answer, prediction)["rouge1"].fmeasure for answer in answers)


Metric = Callable[[str, list[str], Mapping[str, Any]], float]


def word_set_recall(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """Share of the answer's distinct words found among the prediction's, both lower-cased and split on whitespace
    (punctuation stays attached: "day." is not "day") — how the PyramidKV paper's needle figures score a response
    (KVCache-Factory ``scripts/scripts_needle/visualize.py``)."""

    def words(text: str) -> set[str]:
        return set(text.lower().split())

    return max([0.0] + [len(words(prediction) & words(a)) / len(words(a)) for a in answers if words(a)])


# --- RULER: string matching, as RULER's evaluation (scripts/eval/synthetic/constants.py) -------------------------


def string_match_all(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """RULER's string_match_all: the fraction of the expected strings found in the prediction (case-insensitive)."""
    return sum(answer.lower() in prediction.lower() for answer in answers) / len(answers) if answers else 0.0


def string_match_part(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """RULER's string_match_part: 1 if any expected string is found in the prediction (case-insensitive), else 0."""
    return float(any(answer.lower() in prediction.lower() for answer in answers))


# --- long outputs: lines in order ------------------------------------------------------------------------------

_LINE_NUMBER = re.compile(r"^\s*\d+\s*[.):]\s*")


def answer_lines(text: str) -> list[str]:
    """The non-empty lines of a text, each without a leading number ("12. ", "3) "), lower-cased, its whitespace
    collapsed and a final full stop dropped."""
    lines = []
    for line in text.splitlines():
        line = " ".join(_LINE_NUMBER.sub("", line).lower().split()).rstrip(".")
        if line:
            lines.append(line)
    return lines


def longest_common_subsequence(first: list[str], second: list[str]) -> int:
    """The length of the longest common subsequence of two lists (dynamic programming, one row at a time)."""
    previous = [0] * (len(second) + 1)
    for item in first:
        current = [0]
        for j, other in enumerate(second):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def line_sequence(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """The answer's lines found in the prediction in the answer's order: the longest common subsequence of the two
    texts' lines (``answer_lines``) over the answer's lines, best over the answers. A skipped, wrong or repeated line
    costs that line only."""
    predicted = answer_lines(prediction)
    expected = [lines for lines in map(answer_lines, answers) if lines]
    return max([0.0] + [longest_common_subsequence(lines, predicted) / len(lines) for lines in expected])


def word_sequence(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """The answer's words found in the prediction in the answer's order: the longest common subsequence of the two
    texts' lower-cased, whitespace-split words over the answer's words, best over the answers."""
    predicted = prediction.lower().split()
    expected = [words for words in (a.lower().split() for a in answers) if words]
    return max([0.0] + [longest_common_subsequence(words, predicted) / len(words) for words in expected])


# --- reasoning sets: final answers ------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# How written answers separate a number's thousands and sign it, beyond ASCII's ``1,250`` and ``-5``: TeX's
# separators (``1{,}250``, ``1\,250``, ``1\!250``; ``\;``, ``\:``, ``\ ``, ``~``), the thin and narrow no-break
# spaces (a separator only before exactly three digits), and the Unicode minus signs (U+2212, its small and
# full-width forms).
_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|\\[,!;: ]|~|[\u2009\u202f])(?=\d{3}(?!\d))")
_MINUS = re.compile("[\u2212\ufe63\uff0d]")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) of a text, braces balanced; for ``\\boxed 5``
    (no brace, as Hendrycks' MATH and Qwen2.5-Math's extractors also read it) the one word after it, up to a space
    or ``$``, never a later ``{…}`` group; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox")
    if text[after : after + 1] in (" ", "\t"):
        return re.split(r"[\s$]", text[after:].lstrip(" \t"), maxsplit=1)[0] or None
    if not text.startswith("{", after):
        return None
    depth = 0
    for index in range(after, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[after + 1 : index]
    return None


def plain_numbers(text: str) -> str:
    """``text`` with TeX's and Unicode's thousands separators and minus signs written the ASCII way (``1{,}250`` →
    ``1250``, ``−5`` → ``-5``), so that a number reads as written."""
    return _MINUS.sub("-", _THOUSANDS.sub("", text))


def _as_number(text: str):
    from decimal import Decimal, InvalidOperation

    try:
        return Decimal(plain_numbers(text).replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def final_number(text: str) -> str | None:
    """A prediction's final answer as a number: the last number in its last ``\\boxed{}`` if it has one, else the
    first after its last GSM8K ``####``, else the last number in it (lm-evaluation-harness's flexible extraction);
    separators dropped, minus signs read as ``-`` (``plain_numbers``)."""
    boxed = last_boxed(text)
    marked = text.rsplit("####", 1)[1] if "####" in text else None
    # the boxed expression's last number; the first number after "####" (GSM8K's own "#### (-?[0-9.,]+)"); the
    # text's last number
    for part, which in ((boxed, -1), (marked, 0), (text, -1)):
        numbers = _NUMBER.findall(plain_numbers(part)) if part is not None else []
        if numbers:
            return numbers[which].replace(",", "")
    return None


def gsm8k_number(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """1 if the prediction's final number (``final_number``) equals the reference's (GSM8K's number after ``####``,
    as the task stores it) as numbers (72 = 72.0 = 72.00), else 0."""
    found = final_number(prediction)
    value = _as_number(found) if found is not None else None
    return float(value is not None and any(_as_number(a.strip()) == value for a in answers))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def math_equivalence(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """1 if the prediction's final answer is mathematically equivalent to the reference, as math-verify decides:
    the reference parsed as LaTeX (``\\boxed{answer}``), the prediction's last boxed (or final) expression parsed by
    math-verify's default extraction, compared symbolically (14/3 = \\frac{14}{3} = \\dfrac{14}{3}, sets and
    intervals, units and degree signs ignored) — MATH-500's and AIME's scoring in Hugging Face's open-r1 / lighteval.
    Parsing and comparing have 5 s timeouts in the main thread (math-verify's signal alarm); elsewhere none."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise PkvError("scoring math answers needs the PyPI package math-verify: pip install math-verify") from None
    timeout = 5 if _main_thread() else None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    predicted = parse(prediction, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    for answer in answers:
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        if gold and verify(gold, predicted, timeout_seconds=timeout):
            return 1.0
    return 0.0


# --- LongBench (v1 and LongBench-E): the official scorer's metrics, rule for rule -------------------------------
#
# Each function below scores one prediction against one answer the way LongBench's ``metrics.py`` does; the
# registered metrics take the best over a sample's answers (starting from 0, as the official ``scorer`` does).

_EN_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)
# The official Chinese punctuation list, as it is: it has "》" but not "《", and ends with an ASCII ".".
_ZH_PUNCTUATION = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_en(text: str) -> str:
    """Lowercase, drop ASCII punctuation, then the articles a/an/the (whole words), then collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCTUATION)
    return " ".join(_EN_ARTICLES.sub(" ", text).split())


def normalize_zh(text: str) -> str:
    """Lowercase, drop ASCII and the listed Chinese punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION).split())


def token_f1(prediction_tokens: list[str], answer_tokens: list[str]) -> float:
    """Multiset F1 of two token lists (0 when nothing is shared, including when either is empty)."""
    shared = sum((Counter(prediction_tokens) & Counter(answer_tokens)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(prediction_tokens)
    recall = shared / len(answer_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_one(prediction: str, answer: str) -> float:
    return token_f1(normalize_en(prediction).split(), normalize_en(answer).split())


@cache
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # its dictionary-loading chatter goes to stderr otherwise
    return jieba


def jieba_tokens(text: str) -> list[str]:
    """jieba's accurate mode (``cut_all=False``, HMM on), as the official scorer calls it."""
    return list(_jieba().cut(text, cut_all=False))


def qa_f1_zh_one(prediction: str, answer: str) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh(token) for token in jieba_tokens(text)) if t]

    return token_f1(tokens(prediction), tokens(answer))


class _RougeLCall(threading.Thread):
    """One ``rouge`` 1.0.1 ``get_scores`` call on a fresh thread.

    The package reconstructs each longest common subsequence recursively, so long text without a "." raises
    RecursionError, which the official scorer turns into a score of 0. How long is too long depends on how deep
    the call stack already is. On a fresh thread ``get_scores`` runs three Python frames deep, as it does under the
    official ``eval.py`` (module → scorer → rouge_score → get_scores), so the limit falls on the same word for every
    caller of ours (the runner, ``pkvbench score``, tests) and matches the official scorer on the same interpreter.
    """

    def __init__(self, prediction: str, answer: str):
        super().__init__(name="pkvbench-rouge", daemon=True)
        self.prediction, self.answer, self.result = prediction, answer, 0.0

    def run(self) -> None:  # frame 3, under threading's _bootstrap and _bootstrap_inner
        try:
            self.result = _rouge_package().get_scores([self.prediction], [self.answer], avg=True)["rouge-l"]["f"]
        except Exception:  # the official scorer's bare except: any failure scores 0
            self.result = 0.0


@cache
def _rouge_package():
    try:
        from rouge import Rouge
    except ImportError:  # a broken install, not bad input
        raise PkvError("ROUGE-L scoring needs the PyPI package rouge==1.0.1: pip install rouge==1.0.1") from None
    return Rouge()


def rouge_l_one(prediction: str, answer: str) -> float:
    """ROUGE-L F of the ``rouge`` package (1.0.1), as LongBench calls it: text split into sentences at ".",
    words at single spaces, summary-level union LCS over unique words; 0 when the package raises (an empty or
    "."-only prediction or answer, or its recursion limit on long text without a ".")."""
    call = _RougeLCall(prediction, answer)
    call.start()
    call.join()
    return float(call.result)


def rouge_zh_one(prediction: str, answer: str) -> float:
    return rouge_l_one(" ".join(jieba_tokens(prediction)), " ".join(jieba_tokens(answer)))


def classification_one(prediction: str, answer: str, all_classes: list[str]) -> float:
    """Classes named in the prediction; those that are part of the answer but not the answer itself are dropped.

    The official loop removes items from the list it is iterating over, so the item right after each removed one
    is never checked: it is kept even when it should go. Reproduced here: scores depend on it.
    """
    matches = [name for name in all_classes if name in prediction]
    index = 0  # a for-loop over a list walks an index; removing shifts the next item into the place just checked
    while index < len(matches):
        term = matches[index]
        if term in answer and term != answer:
            matches.remove(term)
        index += 1
    return 1.0 / len(matches) if answer in matches else 0.0


def _share_of_numbers(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def _paragraph_share(prediction: str, answer: str, pattern: str) -> float:
    """The share of the numbers in the prediction that equal the answer's paragraph number (an answer without one,
    which the official scorer would crash on, scores 0)."""
    found = re.findall(pattern, answer)
    return _share_of_numbers(prediction, found[0]) if found else 0.0


def retrieval_one(prediction: str, answer: str) -> float:
    return _paragraph_share(prediction, answer, r"Paragraph (\d+)")


def retrieval_zh_one(prediction: str, answer: str) -> float:
    return _paragraph_share(prediction, answer, r"段落(\d+)")


def count_one(prediction: str, answer: str) -> float:
    return _share_of_numbers(prediction, str(answer))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` in its pure-Python form (no python-Levenshtein): 100 for equal strings, 0 when
    either is empty, else round(100 × difflib ``SequenceMatcher(None, a, b).ratio()``), Python's round (half to
    even), autojunk on as difflib's default."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * SequenceMatcher(None, a, b).ratio()))


def code_sim_one(prediction: str, answer: str) -> float:
    """fuzz ratio / 100 of the prediction's first line (after leading newlines) with no "`", "#" or "//"
    ("" if there is none) against the answer."""
    candidate = next(
        (
            line
            for line in prediction.lstrip("\n").split("\n")
            if "`" not in line and "#" not in line and "//" not in line
        ),
        "",
    )
    return fuzz_ratio(candidate, answer) / 100


def first_line(prediction: str) -> str:
    """LongBench's rule for trec, triviaqa, samsum and lsht: strip leading newlines, keep the first line."""
    return prediction.lstrip("\n").split("\n")[0]


PREDICTION_RULES: dict[str, Callable[[str], str]] = {"first_line": first_line}


def prepare_prediction(prediction: str, rules: tuple[str, ...] | list[str] = ()) -> str:
    """Apply a task's prediction rules (``postprocess`` in its YAML) before scoring; the raw text is what's stored."""
    for rule in rules:
        prediction = PREDICTION_RULES[rule](prediction)
    return prediction


def _best_over_answers(one: Callable[[str, str], float], doc: str) -> Metric:
    def metric(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
        return max([0.0] + [float(one(prediction, answer)) for answer in answers])

    metric.__doc__ = doc
    return metric


def longbench_classification(prediction: str, answers: list[str], meta: Mapping[str, Any] | None = None) -> float:
    """Classes named in the prediction, best over the answers (LongBench classification_score)."""
    all_classes = list((meta or {}).get("all_classes") or [])
    return max([0.0] + [classification_one(prediction, answer, all_classes) for answer in answers])


longbench_qa_f1 = _best_over_answers(qa_f1_one, "Token F1 after English normalisation (LongBench qa_f1_score).")
longbench_qa_f1_zh = _best_over_answers(qa_f1_zh_one, "Token F1 over jieba tokens (LongBench qa_f1_zh_score).")
longbench_rouge = _best_over_answers(rouge_l_one, "ROUGE-L F of the rouge 1.0.1 package (LongBench rouge_score).")
longbench_rouge_zh = _best_over_answers(rouge_zh_one, "ROUGE-L F over jieba tokens (LongBench rouge_zh_score).")
longbench_retrieval = _best_over_answers(retrieval_one, "Paragraph-number retrieval (LongBench retrieval_score).")
longbench_retrieval_zh = _best_over_answers(retrieval_zh_one, "段落-number retrieval (LongBench retrieval_zh_score).")
longbench_count = _best_over_answers(count_one, "Passage count (LongBench count_score).")
longbench_code_sim = _best_over_answers(
    code_sim_one, "fuzzywuzzy ratio of the first code line (LongBench code_sim_score)."
)


def dataset_score(scores: list[float]) -> float:
    """LongBench's dataset score: round(100 × mean, 2)."""
    return round(100 * sum(scores) / len(scores), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of a sample by its ``length`` field (words or characters, as the data gives it)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
