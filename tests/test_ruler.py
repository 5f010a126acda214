"""RULER-style synthetic tasks: construction, lengths, determinism, answers derivable from the prompt, metrics."""

import json
import math
import re
from collections import Counter

import pytest

from pkvbench.errors import PkvError
from pkvbench.metrics.functions import string_match_all, string_match_part
from pkvbench.metrics.registry import METRICS
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import all_tasks, build_samples, expand_tasks, get_task
from pkvbench.tasks.ruler import DEPTHS, _singular, fit_length, split_sentences, zeta

RULER_TASKS = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


# --- metrics (hand-made cases) ---------------------------------------------------------------------------------


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The number is 123.", ["123", "456"]) == 0.5
    assert string_match_all("nothing here", ["123"]) == 0.0
    assert string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert string_match_all("1234567", ["123", "4567", "999", "7"]) == 0.75  # substring, not token, matching
    assert METRICS["string_match_all"] is string_match_all


def test_string_match_part():
    assert string_match_part("only 456", ["123", "456"]) == 1.0
    assert string_match_part("Paris", ["paris", "Lyon"]) == 1.0
    assert string_match_part("none", ["123", "456"]) == 0.0
    assert METRICS["string_match_part"] is string_match_part


# --- construction helpers --------------------------------------------------------------------------------------


def test_helpers():
    assert split_sentences("One. Two!  Three? Four") == ["One.", "Two!", "Three?", "Four"]
    assert math.isclose(zeta(2.0), math.pi**2 / 6, rel_tol=1e-12)
    assert DEPTHS[:4] == [0, 3, 5, 8] and DEPTHS[-1] == 100 and len(DEPTHS) == 40
    single = _singular(get_task("niah_single_1").config)
    assert single[0].startswith("A special magic {type_needle_v} is hidden") and single[2] == "number"
    assert "What is the special magic" in single[0] and single[1].endswith("mentioned in the provided text is")
    plural = _singular(get_task("niah_multivalue").config)
    assert plural[0].startswith("Some special magic {type_needle_v} are hidden") and plural[2] == "numbers"


def test_fit_length_picks_the_closest_size():
    def build(n):  # 10 fixed tokens + 7 per unit
        return [0] * (10 + 7 * n)

    assert len(fit_length(build, 1000, 0)[1]) in (997, 1004)
    assert fit_length(build, 5, 0) == (0, [0] * 10)  # below the fixed part: the smallest prompt
    assert fit_length(build, 10**6, 0, high=100) == (100, [0] * 710)  # capped


def test_group_expands_to_all_tasks_in_ruler_order():
    assert [t.name for t in expand_tasks(["ruler"])] == RULER_TASKS
    assert [t.name for t in expand_tasks(["vt", "ruler"])][:2] == ["vt", "niah_single_1"]
    for name in RULER_TASKS:
        spec = all_tasks()[name]
        assert spec.metric == "string_match_all" and spec.chat_template
    assert {all_tasks()[n].max_new_tokens for n in RULER_TASKS} == {128, 30, 120, 50}


# --- generated samples (the embedded model's tokenizer) --------------------------------------------------------


@pytest.fixture(scope="module")
def samples(tokenizer):
    options = TaskOptions(lengths=(1000, 2000), limit=2, seed=0)
    return {name: build_samples(get_task(name), tokenizer, options) for name in RULER_TASKS}


def user_turn(tokenizer, sample) -> str:
    """The last user turn of a decoded chat prompt."""
    text = tokenizer.decode(sample.input_ids)
    return text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]


def test_every_prompt_has_its_length(samples):
    for name, task_samples in samples.items():
        assert [s.sample_id for s in task_samples] == ["len1000_0", "len1000_1", "len2000_0", "len2000_1"], name
        for sample in task_samples:
            assert abs(len(sample.input_ids) - sample.extras["length"]) <= 0.02 * sample.extras["length"], name


def test_generation_is_deterministic_by_seed(samples, tokenizer):
    for name in RULER_TASKS:
        again = build_samples(get_task(name), tokenizer, TaskOptions(lengths=(2000,), limit=1, seed=0))
        assert again[0] == samples[name][2], name  # same seed: same prompt and answers, whatever else was asked
        other = build_samples(get_task(name), tokenizer, TaskOptions(lengths=(2000,), limit=1, seed=1))
        assert other[0].input_ids != again[0].input_ids and other[0].answers != again[0].answers, name
        chosen = build_samples(get_task(name), tokenizer, TaskOptions(lengths=(1000, 2000), sample_ids=("len1000_1",)))
        assert chosen == [samples[name][1]], name


def test_needles_hold_the_answers(samples, tokenizer):
    for name in RULER_TASKS[:8]:
        config = get_task(name).config
        for sample in samples[name]:
            text = user_turn(tokenizer, sample)
            question = text.rsplit("\n", 1)[1]
            keys = re.split(
                r", and |, ", re.fullmatch(r"What .* for (.*) mentioned in the provided text\?", question).group(1)
            )
            assert len(keys) == config["num_queries"], (name, question)
            expected = config["num_values"] * config["num_queries"]
            assert len(sample.answers) == len(set(sample.answers)) == expected
            for answer in sample.answers:
                assert re.fullmatch(r"\d{7}" if config["value_type"] == "numbers" else UUID, answer)
                owner = [k for k in keys if f"for {k} is: {answer}." in text]
                assert len(owner) == 1, (name, answer)  # the answer is the value of an asked key's needle
            for key in keys:  # and the asked keys have no other values
                assert set(re.findall(rf"for {re.escape(key)} is: (\S+)\.", text)) <= set(sample.answers)
            if config["haystack"] == "repeat":
                assert text.count(config["noise"]) > 20
            if config["haystack"] == "needle":
                assert text.count("One of the special magic") > 5 + len(sample.answers)


def test_vt_answer_follows_the_chain(samples, tokenizer):
    for sample in samples["vt"]:
        text = user_turn(tokenizer, sample)
        example, task = text.split("\n\n\n\n")
        value = re.search(r"assigned the value (\d+) in the text above", task).group(1)
        edges = dict(re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)", task))
        resolved = {}
        for name in edges:
            target = edges[name]
            while target.startswith("VAR "):
                target = edges[target[4:]]
            resolved[name] = target
        assert sorted(n for n, v in resolved.items() if v == value) == sorted(sample.answers)
        assert len(sample.answers) == 5 and all(re.fullmatch(r"[A-Z]{5}", a) for a in sample.answers)
        assert re.search(r"VAR [A-Z]{3} = \d+", example)  # the worked example, with 3-letter variables
        prompt = sample.input_ids
        assert tokenizer.decode(prompt).endswith(f"5 variables are assigned the value {value}, they are: ")
    # The worked example is the same for every sample of a seed.
    examples = {user_turn(tokenizer, s).split("\n\n\n\n")[0] for s in samples["vt"]}
    assert len(examples) == 1


def test_cwe_answers_are_the_most_common_words(samples, tokenizer):
    for sample in samples["cwe"]:
        text = user_turn(tokenizer, sample)
        words = re.findall(r"\d+\. (\S+)", text.split("\n")[1])
        counts = Counter(words).most_common()
        assert {w for w, _ in counts[:10]} == set(sample.answers) and len(sample.answers) == 10
        assert counts[9][1] == 6 and counts[10][1] == 1  # RULER's short-context setting: 6 against 1
    decoded = tokenizer.decode(samples["cwe"][0].input_ids)
    assert decoded.count("<|im_start|>user") == 2 and decoded.count("<|im_start|>assistant") == 2  # one solved example


def test_fwe_answers_are_the_most_frequent_words(samples, tokenizer):
    for sample in samples["fwe"]:
        context = user_turn(tokenizer, sample).split("coded words. ", 1)[1].split("\nQuestion:")[0]
        counts = Counter(w for w in context.split() if w != "...").most_common()
        assert [w for w, _ in counts[:3]] == sample.answers
        assert counts[2][1] > counts[3][1]


def test_too_short_a_length_is_refused(tokenizer):
    with pytest.raises(PkvError, match="too short"):
        build_samples(get_task("vt"), tokenizer, TaskOptions(lengths=(300,), limit=1))


@pytest.mark.model
def test_ruler_runs_on_the_model(tmp_path, capsys, loaded):
    from pkvbench.cli import main

    out = tmp_path / "ruler"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                "--quiet",
                "--task",
                "niah_single_1,fwe",
                "--lengths",
                "500",
                "--limit",
                "1",
                "--policy",
                "full,pyramidkv",
                "--budget",
                "64",
                "--max-new-tokens",
                "12",
                "--out",
                str(out),
            ]
        )
    assert exit_info.value.code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["task"] for r in rows} == {"niah_single_1", "fwe"}
    assert all(0 <= r["score"] <= 1 and abs(r["context_tokens"] - 500) <= 10 for r in rows)
