"""Every metric against values worked out by hand from the official LongBench scorer's rules, quirks included."""

import math

import pytest

from pkvbench.metrics.functions import (
    classification_one,
    code_sim_one,
    count_one,
    dataset_score,
    first_line,
    fuzz_ratio,
    jieba_tokens,
    length_bucket,
    normalize_en,
    normalize_zh,
    prepare_prediction,
    qa_f1_one,
    qa_f1_zh_one,
    retrieval_one,
    retrieval_zh_one,
    rouge1,
    rouge_l_one,
    rouge_zh_one,
)
from pkvbench.metrics.registry import METRICS


def f_lcs(p: float, r: float) -> float:
    """The rouge package's F: 2·(p·r)/(p + r + 1e-8)."""
    return 2.0 * ((p * r) / (p + r + 1e-8))


# --- qa_f1 -----------------------------------------------------------------------------------------------------


def test_english_normalisation():
    assert normalize_en("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_en("the-end") == "theend"  # punctuation goes first, so "the" is no longer a word
    assert normalize_en("Another theater, an apple") == "another theater apple"
    assert normalize_en("Tower’s") == "tower’s"  # only ASCII punctuation is removed


def test_qa_f1():
    assert qa_f1_one("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1_one("a cat and the dog", "cat dog dog") == pytest.approx(2 / 3)  # multiset: one "dog" shared
    assert qa_f1_one("another theater", "theater") == pytest.approx(2 / 3)
    assert qa_f1_one("tower's", "towers") == 1.0 and qa_f1_one("tower’s", "towers") == 0.0
    assert qa_f1_one("", "anything") == 0.0 and qa_f1_one("the", "the") == 0.0  # nothing left to share
    assert METRICS["qa_f1"]("Paris", ["London", "paris.", "Rome"], {}) == 1.0  # best over the answers
    assert METRICS["qa_f1"]("Paris", [], {}) == 0.0


def test_qa_f1_zh():
    assert jieba_tokens("《北京》") == ["《", "北京", "》"]
    # "《" is not in the official punctuation list (its partner "》" is): it stays a token.
    assert normalize_zh("《 》。A b") == "《ab"
    assert qa_f1_zh_one("《北京》", "北京") == pytest.approx(2 / 3)
    assert qa_f1_zh_one("北京。", "北京") == 1.0
    assert qa_f1_zh_one("我爱北京", "北京") == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))
    assert METRICS["qa_f1_zh"]("上海", ["北京", "上海"], {}) == 1.0


# --- rouge (the rouge 1.0.1 package) ---------------------------------------------------------------------------


def test_rouge_l_unique_words_and_sentences():
    # LCS of "the cat sat" in the prediction: 3 of the reference's 3 unique words, the prediction has 5 unique words.
    assert rouge_l_one("the cat sat on the mat", "the cat sat") == pytest.approx(f_lcs(3 / 5, 1.0), abs=1e-15)
    # Repeats count once: words are sets.
    assert rouge_l_one("the the the", "the") == pytest.approx(f_lcs(1.0, 1.0), abs=1e-15)
    # "." splits sentences; the union of per-sentence LCS words counts, so a split can raise the score.
    assert rouge_l_one("cat sat the mat", "the cat sat") == pytest.approx(f_lcs(2 / 4, 2 / 3), abs=1e-15)
    assert rouge_l_one("cat sat. the mat", "the cat sat") == pytest.approx(f_lcs(3 / 4, 1.0), abs=1e-15)


def test_rouge_l_failures_score_zero():
    assert rouge_l_one("", "the cat") == 0.0
    assert rouge_l_one("...", "the cat") == 0.0  # only "." → no sentence → the package raises
    assert rouge_l_one("the cat", "") == 0.0
    # Long text without "." exhausts the package's recursive LCS walk; the official scorer then gives 0.
    words = [f"w{i}" for i in range(2000)]
    assert rouge_l_one(" ".join(words), "w0") == 0.0
    dotted = ". ".join(" ".join(words[i : i + 100]) for i in range(0, 2000, 100))
    assert rouge_l_one(dotted, "w0") == pytest.approx(f_lcs(1 / 2000, 1.0), abs=1e-15)
    assert METRICS["rouge"]("the cat", ["dog", "the cat"], {}) == pytest.approx(f_lcs(1.0, 1.0))


def test_rouge_recursion_limit_matches_the_official_call_depth(tmp_path):
    """The largest failing length is the one a script shaped like the official eval.py hits on this interpreter."""
    import subprocess
    import sys

    script = tmp_path / "official_like.py"
    script.write_text(
        "from rouge import Rouge\n"
        "def rouge_score(prediction, ground_truth):\n"
        "    try:\n"
        "        return Rouge().get_scores([prediction], [ground_truth], avg=True)['rouge-l']['f']\n"
        "    except Exception:\n"
        "        return 0.0\n"
        "def scorer(prediction, answer):\n"
        "    return max(0.0, rouge_score(prediction, answer))\n"
        "import sys\n"
        "results = []\n"
        "for n in sys.argv[1:]:\n"  # called from module level, as eval.py's main block calls scorer
        "    prediction = ' '.join('w%d' % i for i in range(int(n)))\n"
        "    results.append(str(int(scorer(prediction, 'w0') > 0)))\n"
        "print(' '.join(results))\n"
    )

    def ours(n: int) -> int:
        return int(rouge_l_one(" ".join(f"w{i}" for i in range(n)), "w0") > 0)

    # Find our boundary, then check the official-shaped call agrees on both sides of it.
    lo, hi = 100, 3000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ours(mid) else (lo, mid - 1)
    lengths = [lo - 1, lo, lo + 1, lo + 2]
    official = subprocess.run(
        [sys.executable, str(script), *map(str, lengths)], capture_output=True, text=True, check=True
    )
    assert official.stdout.split() == [str(ours(n)) for n in lengths] == ["1", "1", "0", "0"]


def test_rouge_zh():
    assert rouge_zh_one("我爱北京", "我爱北京") == pytest.approx(f_lcs(1.0, 1.0), abs=1e-15)
    assert rouge_zh_one("我爱北京", "北京") == pytest.approx(f_lcs(1 / 3, 1.0), abs=1e-15)
    # Chinese text has no "." to split at: a long prediction fails the package's recursion and scores 0.
    long = "你好" + "我爱北京" * 400
    assert jieba_tokens(long)[0] == "你好"
    assert rouge_zh_one(long, "你好") == 0.0
    assert rouge_zh_one("你好" + ".".join(["我爱北京" * 50] * 8), "你好") > 0


def test_rouge1_keeps_its_behaviour():
    assert rouge1("The best thing is a sandwich", ["The best thing to do is eat a sandwich"]) == pytest.approx(
        2 * (6 / 6) * (6 / 9) / (6 / 6 + 6 / 9)
    )


# --- classification --------------------------------------------------------------------------------------------


def test_classification():
    classes = ["Human", "Location", "Number"]
    assert classification_one("Location", "Location", classes) == 1.0
    assert classification_one("Location or Human", "Location", classes) == 0.5
    assert classification_one("Number", "Location", classes) == 0.0
    assert classification_one("nothing", "Location", classes) == 0.0
    # A class that is part of the answer but is not the answer is dropped: "A" inside "AB".
    assert classification_one("AB", "AB", ["A", "AB", "C"]) == 1.0


def test_classification_skips_the_item_after_a_removal():
    # The official loop removes "A" while iterating, so "B" slides into its place and is never checked: it stays,
    # and the answer's share is 1/2 where the evident intent would give 1.
    assert classification_one("ABC", "ABC", ["A", "B", "ABC"]) == 0.5
    # With a non-removable item between them both removable ones go.
    assert classification_one("ABC", "ABC", ["A", "ABC", "B"]) == 1.0
    assert METRICS["classification"]("ABC", ["ABC"], {"all_classes": ["A", "B", "ABC"]}) == 0.5


# --- retrieval, count, code ------------------------------------------------------------------------------------


def test_retrieval_and_count():
    assert retrieval_one("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_one("Paragraph 3, or maybe Paragraph 12", "Paragraph 3") == 0.5
    assert retrieval_one("Paragraph 30", "Paragraph 3") == 0.0  # whole numbers compare as strings
    assert retrieval_one("no idea", "Paragraph 3") == 0.0
    assert retrieval_zh_one("答案是段落5", "段落5") == 1.0
    assert retrieval_zh_one("段落5和段落6", "段落5") == 0.5
    assert count_one("There are 12 unique paragraphs: 12.", "12") == 1.0
    assert count_one("12 or 13", "12") == 0.5
    assert count_one("twelve", "12") == 0.0
    assert METRICS["count"]("7", [7], {}) == 1.0  # answers compared as strings


def test_fuzz_ratio_is_fuzzywuzzys_pure_python_ratio():
    assert fuzz_ratio("abc", "abc") == 100
    assert fuzz_ratio("", "") == 100  # equality is checked before emptiness
    assert fuzz_ratio("abc", "") == 0
    assert fuzz_ratio("abcdefgh", "aijklmno") == 12  # 2·1/16 = 12.5 → Python rounds half to even
    assert fuzz_ratio("abcdefgh", "abcxyzuv") == 38  # 2·3/16 = 37.5 → 38
    # difflib's autojunk (on by default) treats characters popular in a 200+ character string as junk.
    long_a, long_b = "x" * 150 + "a" * 60, "a" * 60 + "x" * 150
    from difflib import SequenceMatcher

    assert fuzz_ratio(long_a, long_b) == int(round(100 * SequenceMatcher(None, long_a, long_b).ratio()))
    assert fuzz_ratio(long_a, long_b) != int(round(100 * SequenceMatcher(None, long_a, long_b, autojunk=False).ratio()))


def test_fuzz_ratio_against_fuzzywuzzy_when_installed():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    import random

    rng = random.Random(7)
    for _ in range(500):
        a, b = ("".join(rng.choice("ab c(=)\t") for _ in range(rng.choice([0, 3, 40, 260]))) for _ in range(2))
        assert fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


def test_code_sim():
    prediction = "```python\n# the next line\nx = foo(1)\ny = 2\n"
    assert code_sim_one(prediction, "x = foo(1)") == 1.0
    assert code_sim_one("\n\nx = foo(1)", "x = foo(1)") == 1.0
    assert code_sim_one("x = 1  # set x\n// note\nreturn x;", "return x;") == 1.0
    assert code_sim_one("// only\n", "abc") == 0.0  # the line after is "" → candidate ""
    assert code_sim_one("abcdefgh", "aijklmno") == 0.12
    assert code_sim_one("# c", "") == 1.0  # no candidate line → "" equals the empty answer


# --- prediction rules and aggregation ---------------------------------------------------------------------------


def test_first_line_rule():
    assert first_line("\n\nLocation\nHuman") == "Location"
    assert first_line("Location") == "Location"
    assert first_line("\n") == ""
    assert first_line(" \nx") == " "  # only newlines are stripped
    assert prepare_prediction("\nA\nB", ("first_line",)) == "A"
    assert prepare_prediction("\nA\nB", ()) == "\nA\nB"


def test_dataset_score_and_buckets():
    assert dataset_score([1.0, 0.0, 0.5]) == 50.0
    assert dataset_score([1 / 3]) == 33.33
    assert dataset_score([0.123456, 0.0]) == 6.17
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 20000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


def test_score_rows_applies_rules_and_buckets():
    from pkvbench.tasks.scoring import score_rows

    rows = [
        {
            "dataset": "trec",
            "pred": "\n\nLocation\nHuman",
            "answers": ["Location"],
            "all_classes": ["Human", "Location"],
        },
        {"dataset": "trec", "pred": "Location Human", "answers": ["Location"], "all_classes": ["Human", "Location"]},
        {"dataset": "passage_count_e", "pred": "3", "answers": ["3"], "length": 3000},
        {"dataset": "passage_count_e", "pred": "4", "answers": ["3"], "length": 9000},
        {"dataset": "lcc", "pred": "x = 1", "answers": ["x = 1"], "all_classes": None},
    ]
    scored, summary = score_rows(rows)
    assert [r["score"] for r in scored] == [1.0, 0.5, 1.0, 0.0, 1.0]
    by_name = {entry["dataset"]: entry for entry in summary}
    assert by_name["trec"]["score"] == 75.0 and by_name["trec"]["n"] == 2
    e = by_name["passage_count_e"]
    assert (e["score"], e["0-4k"], e["8k+"]) == (50.0, 100.0, 0.0) and math.isnan(e["4-8k"])
    assert "0-4k" not in by_name["lcc"]
