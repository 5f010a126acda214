"""TREC few-shot (LongBench's trec construction rebuilt from the TREC files): prompts, answers, metric, errors."""

import json
from pathlib import Path

import pytest

from pkvbench.errors import PkvError
from pkvbench.metrics.functions import prepare_prediction
from pkvbench.metrics.registry import METRICS
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from pkvbench.tasks.trec import read_trec

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TREC = SHARED / "trec"
needs_trec = pytest.mark.skipif(not (TREC / "train_5500.label").is_file(), reason="no TREC copy in ../shared/data/trec")


def score(prediction: str, answer: str, all_classes: list[str]) -> float:
    spec = get_task("trec-fewshot")
    return METRICS[spec.metric](
        prepare_prediction(prediction, spec.postprocess), [answer], {"all_classes": all_classes}
    )


def test_metric_is_longbench_classification_on_the_first_line():
    names = list(get_task("trec-fewshot").config["classes"].values())
    assert len(names) == len(set(names)) == 50 and "Lasting time of somethin" in names
    assert score(" Individual\nQuestion: Who is it ?\nType: Country", "Individual", names) == 1.0
    assert score("\n\nCountry\nIndividual", "Country", names) == 1.0  # leading newlines stripped, then first line
    assert score("Individual", "Country", names) == 0.0
    assert score("Country or City", "City", names) == 0.5  # two classes named: 1/2
    assert score("", "City", names) == 0.0
    # A named class that is part of the answer (not the answer) is dropped; the official loop then skips the next.
    assert score("Date Date of birth", "Date of birth", ["Date", "Date of birth"]) == 1.0
    assert score("A B AB", "AB", ["A", "B", "AB"]) == 0.5


def test_yaml_keeps_longbench_prompt_length_and_classes():
    config = get_task("trec-fewshot").config
    assert not get_task("trec-fewshot").chat_template and get_task("trec-fewshot").postprocess == ("first_line",)
    longbench = SHARED / "longbench" / "config"
    if not (longbench / "dataset2prompt.json").is_file():
        pytest.skip("no LongBench config in ../shared/data")
    assert config["prompt"] == json.loads((longbench / "dataset2prompt.json").read_text())["trec"]
    assert (
        get_task("trec-fewshot").max_new_tokens == json.loads((longbench / "dataset2maxlen.json").read_text())["trec"]
    )
    rows = [line.split("\t") for line in (TREC / "longbench_classes.tsv").read_text().splitlines()[1:]]
    assert config["classes"] == dict(rows)


def write_trec(folder: Path, train: list[str], test: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "train_5500.label").write_text("\n".join(train) + "\n", encoding="latin-1")
    (folder / "TREC_10.label").write_text("\n".join(test) + "\n", encoding="latin-1")


def test_data_errors_are_one_clear_line(tmp_path, tokenizer):
    spec = get_task("trec-fewshot")
    with pytest.raises(PkvError, match="needs --data-dir"):
        build_samples(spec, tokenizer, TaskOptions(lengths=(500,), limit=1))
    with pytest.raises(PkvError, match="train_5500.label not found"):
        build_samples(spec, tokenizer, TaskOptions(lengths=(500,), limit=1, data_dir=str(tmp_path)))
    write_trec(tmp_path, ["HUM:ind Who wrote Hamlet ?"] * 40, ["LOC:city What city is the Louvre in ?"])
    with pytest.raises(PkvError, match="sha256 differs"):
        build_samples(spec, tokenizer, TaskOptions(lengths=(500,), limit=1, data_dir=str(tmp_path)))
    # With --no-verify a small copy works: the context is made of its examples.
    sample = build_samples(spec, tokenizer, TaskOptions(lengths=(300,), limit=1, data_dir=str(tmp_path), verify=False))[
        0
    ]
    text = tokenizer.decode(sample.input_ids)
    assert sample.answers == ["City"] and text.endswith("\n\nQuestion: What city is the Louvre in ?\nType:")
    assert text.count("Question: Who wrote Hamlet ?\nType: Individual\n") > 5
    write_trec(tmp_path, ["HUM:ind Who wrote Hamlet ?", "junk"], ["LOC:city What city ?"])
    read_trec.cache_clear()
    with pytest.raises(PkvError, match="not a TREC line"):
        build_samples(spec, tokenizer, TaskOptions(lengths=(300,), limit=1, data_dir=str(tmp_path), verify=False))
    read_trec.cache_clear()


@needs_trec
def test_samples_from_the_trec_files(tokenizer):
    spec = get_task("trec-fewshot")
    classes = spec.config["classes"]
    train = set(read_trec(str(TREC / "train_5500.label")))
    test = {q: lab for lab, q in read_trec(str(TREC / "TREC_10.label"))}
    options = TaskOptions(lengths=(1000, 2000), limit=3, seed=0, data_dir=str(TREC))
    samples = build_samples(spec, tokenizer, options)
    assert [s.sample_id for s in samples] == [f"len{n}_{i}" for n in (1000, 2000) for i in range(3)]
    by_label = {name: label for label, name in classes.items()}
    for sample in samples:
        assert abs(len(sample.input_ids) - sample.extras["length"]) <= 0.02 * sample.extras["length"]
        assert sample.meta["all_classes"] == list(classes.values())
        text = tokenizer.decode(sample.input_ids)
        head = "Please determine the type of the question below. Here are some examples of questions.\n\n"
        assert text.startswith(head)
        context, question = text[len(head) :].rsplit("\n\nQuestion: ", 1)
        question = question.removesuffix("\nType:")
        assert sample.answers == [classes[test[question]]]  # the answer is the test question's class name
        shots = context.split("\n")
        assert len(shots) % 2 == 0 and len(shots) > 40
        for q, t in zip(shots[::2], shots[1::2]):  # every example is a real training question with its class
            assert (by_label[t.removeprefix("Type: ")], q.removeprefix("Question: ")) in train
    # Sample i asks the same question at every length; the seed decides questions and examples.
    assert [s.answers for s in samples[:3]] == [s.answers for s in samples[3:]]
    again = build_samples(spec, tokenizer, TaskOptions(lengths=(2000,), limit=3, seed=0, data_dir=str(TREC)))
    assert again == samples[3:]
    other = build_samples(spec, tokenizer, TaskOptions(lengths=(2000,), limit=3, seed=1, data_dir=str(TREC)))
    assert [s.input_ids for s in other] != [s.input_ids for s in again]
    picked = build_samples(
        spec, tokenizer, TaskOptions(lengths=(1000, 2000), sample_ids=("len2000_1",), data_dir=str(TREC))
    )
    assert picked == [samples[4]]
