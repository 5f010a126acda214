"""Long-output tasks (list-recall, chain-trace) and the reasoning sets (GSM8K, MATH-500, AIME 2025): samples, their
scoring, and reasoning data read from local JSON lines and scored against a golden file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pkvbench.errors import PkvError
from pkvbench.metrics.functions import answer_lines, line_sequence, longest_common_subsequence, word_sequence
from pkvbench.metrics.registry import METRICS
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

DATA = Path(__file__).parent / "data" / "reasoning"


def test_line_sequence_counts_the_answers_lines_in_order():
    answer = "1. apple\n2. river\n3. stone\n4. cloud"
    assert line_sequence(answer, [answer]) == 1.0
    assert line_sequence("apple\nriver\nStone.\ncloud", [answer]) == 1.0  # numbers, case, full stop ignored
    assert line_sequence("1. apple\n2. stone\n3. cloud", [answer]) == 0.75  # one skipped line costs one line
    assert line_sequence("1. cloud\n2. stone\n3. river\n4. apple", [answer]) == 0.25  # order matters
    assert line_sequence("", [answer]) == 0.0
    assert answer_lines(" 12) After a comes b. \n\n") == ["after a comes b"]
    assert longest_common_subsequence(list("abcbdab"), list("bdcaba")) == 4
    assert word_sequence("The cat sat on mat.", ["the cat sat on the mat."]) == 5 / 6


@pytest.mark.parametrize("name", ["list-recall", "chain-trace", "passage-copy"])
def test_long_output_samples_have_long_answers_that_only_the_prompt_holds(tokenizer, name):
    task = get_task(name)
    samples = build_samples(task, tokenizer, TaskOptions(limit=3, seed=1))
    again = build_samples(task, tokenizer, TaskOptions(limit=3, seed=1))
    assert [s.input_ids for s in samples] == [s.input_ids for s in again], "the same samples for the same seed"
    assert len({tuple(s.input_ids) for s in samples}) == 3
    for sample in samples:
        answer = sample.answers[0]
        assert len(tokenizer.encode(answer, add_special_tokens=False)) >= 256
        lines = answer_lines(answer)
        context = tokenizer.decode(sample.context_ids)
        assert all(line.split()[-1] in context.lower() for line in lines), "every line ends with a word of the context"
        if name == "passage-copy":
            first = tokenizer.decode(sample.questions[0].ids).rstrip("\n").rsplit("\n", 1)[-1]  # the assistant's
            assert first[0].isupper() and f"{first}\n{answer}" in context  # first sentence, then the answer's lines
        elif name == "chain-trace":  # shuffled in the prompt, walked in order in the answer, after its first fact
            first = tokenizer.decode(sample.questions[0].ids).rstrip("\n").rsplit("\n", 1)[-1]
            assert first.startswith("After ") and lines[0].startswith("after " + first.split()[-1].rstrip("."))
            assert lines[0].split()[-1] in lines[1] and answer not in context
        else:
            assert answer in context
        assert METRICS[task.metric](answer, sample.answers, sample.meta) == 1.0


def reasoning_samples(tokenizer, name, **options):
    return build_samples(get_task(name), tokenizer, TaskOptions(data_dir=str(DATA), **options))


def test_reasoning_sets_read_local_json_lines_with_their_official_answers(tokenizer):
    gsm8k = reasoning_samples(tokenizer, "gsm8k")
    assert [s.sample_id for s in gsm8k] == ["0", "1", "2", "3"]
    assert [s.answers for s in gsm8k] == [["72"], ["5,000"], ["9.25"], ["-5"]]  # the number after ####
    math = reasoning_samples(tokenizer, "math500", limit=2)
    assert [s.sample_id for s in math] == ["test/prealgebra/1.json", "test/precalculus/2.json"]
    assert math[1].answers == ["\\frac{\\sqrt{3}}{2}"] and math[0].extras == {"subject": "Prealgebra", "level": 1}
    aime = reasoning_samples(tokenizer, "aime25")
    assert [s.answers for s in aime] == [["70"], ["033"]]  # question or problem, either field
    text = tokenizer.decode(math[1].input_ids)
    assert "Find $\\cos 30^\\circ$." in text and "\\boxed{}" in text
    assert "Please reason step by step" in tokenizer.decode(math[1].questions[0].ids)  # the instruction follows
    for name in ("gsm8k", "math500", "aime25"):
        assert get_task(name).max_new_tokens >= 8192
    assert get_task("aime25").max_new_tokens == 32768


def test_reasoning_answers_are_scored_as_the_golden_file_says(tokenizer):
    samples = {
        (name, s.sample_id): s for name in ("gsm8k", "math500", "aime25") for s in reasoning_samples(tokenizer, name)
    }
    golden = [json.loads(line) for line in (DATA / "golden.jsonl").read_text().splitlines()]
    assert len(golden) >= 30
    wrong = []
    for case in golden:
        sample = samples[case["task"], case["sample_id"]]
        score = METRICS[get_task(case["task"]).metric](case["pred"], sample.answers, sample.meta)
        if score != case["score"]:
            wrong.append((case, score))
    assert not wrong


def test_a_reasoning_set_without_its_file_says_where_to_put_it(tokenizer, tmp_path):
    with pytest.raises(PkvError, match=r"math500.jsonl not found; put math500.jsonl .* --data-dir"):
        build_samples(get_task("math500"), tokenizer, TaskOptions(data_dir=str(tmp_path)))
    bad = tmp_path / "gsm8k.jsonl"
    bad.write_text('{"question": "q?"}\n')
    with pytest.raises(PkvError, match="no answer"):
        build_samples(get_task("gsm8k"), tokenizer, TaskOptions(data_dir=str(tmp_path)))


def test_a_reasoning_run_without_data_or_hub_is_one_line_and_exit_2(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pkvbench",
            "run",
            "--task",
            "aime25",
            "--max-new-tokens",
            "64",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "aime25.jsonl" in lines[0] and "--data-dir" in lines[0], run.stderr


def test_answers_longer_than_the_models_window_are_refused_before_anything_runs(capsys, tmp_path):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--task", "aime25", "--data-dir", str(DATA), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and err.count("\n") == 1
        and "leaves no room for a prompt in the context window" in err
    ), err
