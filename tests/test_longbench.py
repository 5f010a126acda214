"""LongBench tasks: definitions against the official config, groups, data loading and checks, prompts, a real run.

Tests that read the official config or data files use ../shared/data/longbench and skip when it is absent.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pkvbench.errors import PkvError
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.longbench import (
    format_prompt,
    hub_rows,
    load_rows,
    longbench_samples,
    read_jsonl,
    truncate_middle,
)
from pkvbench.tasks.registry import all_tasks, expand_tasks, get_task

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "longbench"
needs_data = pytest.mark.skipif(not (DATA / "config").is_dir(), reason="../shared/data/longbench is not here")

PAPER = [
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]
ZH = ["multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"]
E = [
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]
OFFICIAL_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_zh",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "vcsum": "rouge_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}


# --- definitions -----------------------------------------------------------------------------------------------


@needs_data
def test_task_files_hold_the_official_strings_verbatim():
    prompts = json.loads((DATA / "config" / "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads((DATA / "config" / "dataset2maxlen.json").read_text(encoding="utf-8"))
    sums = dict(reversed(line.split()) for line in (DATA / "SHA256SUMS").read_text().splitlines() if line.strip())
    assert len(prompts) == 21
    for base in prompts:
        for name in [base] + ([f"{base}_e"] if base in E else []):
            spec = get_task(name)
            assert spec.config["prompt"] == prompts[base], name  # typos ("asconcisely") and trailing spaces kept
            assert spec.max_new_tokens == maxlen[base]
            assert spec.metric == OFFICIAL_METRIC[base]
            assert spec.config["sha256"] == sums.get(f"{name}.jsonl")
    assert (
        get_task("multi_news")
        .config["prompt"]
        .startswith("You are given several news passages. Write a one-page summary of all news. \n")
    )
    assert get_task("passage_count").config["prompt"].endswith("The final answer is: ")


@needs_data
def test_generator_script_is_up_to_date():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_longbench_tasks.py"), "--check", "--source", str(DATA)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_task_rules():
    raw = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    first_line = {"trec", "triviaqa", "samsum", "lsht"}
    names = [n for n, s in all_tasks().items() if s.generator == "longbench"]
    assert len(names) == 34
    for name in names:
        spec = get_task(name)
        base = name.removesuffix("_e")
        assert spec.chat_template == (base not in raw), name
        assert spec.postprocess == (("first_line",) if base in first_line else ()), name
        assert spec.stop_strings == (("\n",) if base == "samsum" else ()), name


def test_groups():
    assert [t.name for t in expand_tasks(["longbench"])] == PAPER
    assert [t.name for t in expand_tasks(["longbench-zh"])] == ZH
    assert [t.name for t in expand_tasks(["longbench-e"])] == [f"{n}_e" for n in E]
    assert [t.name for t in expand_tasks(["trec", "longbench-zh", "lsht", "trec_e"])] == ["trec", *ZH, "trec_e"]
    with pytest.raises(PkvError, match="unknown task 'nope'; valid groups: .*longbench-e.*valid tasks: .*narrativeqa"):
        expand_tasks(["nope"])


# --- data ------------------------------------------------------------------------------------------------------


@needs_data
def test_checksums_good_and_tampered(tmp_path, capsys):
    spec = get_task("passage_retrieval_zh")
    rows = load_rows(spec, TaskOptions(data_dir=str(DATA), limit=2))
    assert [r["dataset"] for r in rows] == ["passage_retrieval_zh"] * 2
    data = (DATA / "passage_retrieval_zh.jsonl").read_bytes()
    tampered = data.replace("段落1".encode(), "段落2".encode(), 1)
    assert tampered != data
    (tmp_path / "passage_retrieval_zh.jsonl").write_bytes(tampered)
    with pytest.raises(PkvError, match=r"sha256 [0-9a-f]{64} is not the official d71c1f71.*--no-verify"):
        load_rows(spec, TaskOptions(data_dir=str(tmp_path)))
    assert len(load_rows(spec, TaskOptions(data_dir=str(tmp_path), verify=False))) == 200
    # A LongBench-E file has no official checksum: loaded, with a note.
    (tmp_path / "trec_e.jsonl").write_text(
        json.dumps({"input": "q", "context": "c", "answers": ["Human"], "_id": "x", "length": 5}) + "\n"
    )
    assert len(load_rows(get_task("trec_e"), TaskOptions(data_dir=str(tmp_path)))) == 1
    assert "trec_e.jsonl has no official checksum" in capsys.readouterr().err


def row(i, **fields):
    return {
        "input": f"question {i}",
        "context": f"context {i}",
        "answers": [f"answer {i}"],
        "length": 100 * i,
        "dataset": "trec",
        "language": "en",
        "all_classes": ["Human", "Location"],
        "_id": f"id{i}",
        **fields,
    }


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


def test_bad_data_files(tmp_path, capsys):
    spec = get_task("trec")
    options = TaskOptions(data_dir=str(tmp_path), verify=False)
    with pytest.raises(PkvError, match=r"trec.jsonl not found: .* has no such file; download data.zip .* --data-dir"):
        load_rows(spec, options)
    with pytest.raises(PkvError, match="does not exist"):
        load_rows(spec, TaskOptions(data_dir=str(tmp_path / "nowhere")))
    write_rows(tmp_path / "trec.jsonl", [row(1), row(2), "{not json", row(4)])
    with pytest.raises(PkvError, match=r"trec.jsonl, line 3: not valid JSON"):
        load_rows(spec, options)
    write_rows(tmp_path / "trec.jsonl", [row(1), {"input": "q"}])
    with pytest.raises(PkvError, match=r"line 2: missing field\(s\) context, answers, _id"):
        read_jsonl(tmp_path / "trec.jsonl")
    # With the official checksum on, a file that is not the official one is refused before anything else.
    write_rows(tmp_path / "trec.jsonl", [row(1)])
    with pytest.raises(PkvError, match="is not the official"):
        load_rows(spec, TaskOptions(data_dir=str(tmp_path)))


def test_selection_limit_and_rows_without_answers(tmp_path, capsys):
    spec = get_task("trec")
    write_rows(tmp_path / "trec.jsonl", [row(1), row(2, answers=[]), row(3), row(4, answers=[""]), row(5)])

    def select(**kw):
        return [r["_id"] for r in load_rows(spec, TaskOptions(data_dir=str(tmp_path), verify=False, **kw))]

    assert select() == ["id1", "id3", "id5"]
    assert "trec: skipped 2 sample(s) with no answer: id2, id4" in capsys.readouterr().err
    assert select(limit=2) == ["id1", "id3"]
    assert select(sample_ids=("id5", "id1")) == ["id1", "id5"]  # file order
    assert select(sample_ids=("id5", "id1"), limit=1) == ["id1"]
    assert select(sample_ids=("nope",)) == []
    assert "none of the --sample-id values" in capsys.readouterr().err


def test_hub_offline_says_how_to_get_the_data(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    with pytest.raises(
        PkvError, match=r"could not load LongBench trec from the Hugging Face hub .*data.zip.*--data-dir"
    ):
        hub_rows(get_task("trec"))


# --- prompts on real rows (the embedded model's tokenizer) ------------------------------------------------------


@needs_data
@pytest.mark.model
def test_prompts_and_middle_truncation_on_real_rows(loaded):
    tokenizer = loaded.tokenizer
    spec = get_task("multifieldqa_zh")
    rows = read_jsonl(DATA / "multifieldqa_zh.jsonl")[:3]
    prompt = format_prompt(spec, rows[0])
    assert prompt == spec.config["prompt"].replace("{context}", rows[0]["context"]).replace("{input}", rows[0]["input"])
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 4000
    cut, untruncated = truncate_middle(tokenizer, prompt, 1000)
    assert untruncated == len(ids)
    # The first and last 500 tokens, each decoded on its own without special tokens.
    assert cut == tokenizer.decode(ids[:500], skip_special_tokens=True) + tokenizer.decode(
        ids[-500:], skip_special_tokens=True
    )
    assert cut.startswith("阅读以下文字并用中文简短回答：\n\n")
    assert cut.endswith(f"问题：{rows[0]['input']}\n回答：")
    assert abs(len(tokenizer(cut)["input_ids"]) - 1000) <= 4  # re-tokenizing at the seams may merge a few tokens
    assert truncate_middle(tokenizer, prompt, len(ids)) == (prompt, len(ids))  # not longer → untouched
    # Samples: chat template around the (cut) prompt, at most the default max length, answers and meta carried.
    samples = longbench_samples(tokenizer, spec, TaskOptions(data_dir=str(DATA), limit=3))
    window = loaded.config.max_position_embeddings
    for sample, source in zip(samples, rows):
        assert sample.sample_id == source["_id"] and sample.answers == source["answers"]
        assert sample.extras["length"] == source["length"]
        text = tokenizer.decode(sample.input_ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("回答：<|im_end|>\n<|im_start|>assistant\n")
        assert len(sample.input_ids) + spec.max_new_tokens <= window + 4
        if sample.extras["truncated"]:
            assert len(sample.input_ids) >= window - spec.max_new_tokens - 8
        else:
            assert (
                sample.input_ids
                == tokenizer.apply_chat_template(
                    [{"role": "user", "content": format_prompt(spec, source)}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
    assert [s.extras["truncated"] for s in samples] == [True, True, False]
    assert (
        longbench_samples(tokenizer, spec, TaskOptions(data_dir=str(DATA), limit=1, max_length=600))[0].input_ids
        == tokenizer.apply_chat_template(
            [{"role": "user", "content": truncate_middle(tokenizer, prompt, 600)[0]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )


@pytest.mark.model
def test_raw_tasks_skip_the_chat_template(loaded, tmp_path):
    tokenizer = loaded.tokenizer
    write_rows(
        tmp_path / "trec.jsonl",
        [row(1, context="Question: What city? Type: Location", input="Question: Who is he? Type:")],
    )
    sample = longbench_samples(tokenizer, get_task("trec"), TaskOptions(data_dir=str(tmp_path), verify=False))[0]
    prompt = (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "Question: What city? Type: Location\nQuestion: Who is he? Type:"
    )
    assert sample.input_ids == tokenizer(prompt)["input_ids"]
    assert sample.meta == {"all_classes": ["Human", "Location"]}
    assert sample.extras["all_classes"] == ["Human", "Location"]  # in the result rows, so they can be rescored


# --- end to end ------------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.model
def test_run_real_samples_and_rescore(tmp_path, capsys, loaded):
    from pkvbench.cli import main
    from pkvbench.tasks.scoring import score_rows

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                "--quiet",
                "--task",
                "passage_retrieval_zh,multi_news",
                "--data-dir",
                str(DATA),
                "--limit",
                "2",
                "--max-length",
                "400",
                "--max-new-tokens",
                "12",
                "--policy",
                "full,pyramidkv",
                "--budget",
                "0.12",
                "--out",
                str(out),
            ]
        )
    printed = capsys.readouterr()
    assert exit_info.value.code == 0, printed.err
    assert "8 rows written" in printed.out
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["task"] for r in rows} == {"passage_retrieval_zh", "multi_news"}
    for r in rows:
        assert 0 <= r["score"] <= 1 and r["truncated"] is True and r["context_tokens"] <= 400 + 40
    # `pkvbench score` on the run's own rows gives the scores the run recorded.
    rescored, summary = score_rows([{k: v for k, v in r.items() if k != "score"} for r in rows])
    assert [r["score"] for r in rescored] == [r["score"] for r in rows]
    assert {(e["dataset"], e["policy"]) for e in summary} == {
        (t, p) for t in ("passage_retrieval_zh", "multi_news") for p in ("full", "pyramidkv")
    }


# --- pkvbench score --------------------------------------------------------------------------------------------


def score_cli(capsys, *args):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["score", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_score_command(tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    write_rows(
        preds,
        [
            {
                "dataset": "trec",
                "pred": "\nLocation\nHuman",
                "answers": ["Location"],
                "all_classes": ["Human", "Location"],
            },
            {"dataset": "trec", "pred": "Human", "answers": ["Location"], "all_classes": ["Human", "Location"]},
            {"dataset": "passage_count_e", "pred": "3", "answers": ["3"], "all_classes": None, "length": 5000},
        ],
    )
    code, out, err = score_cli(capsys, str(preds))
    assert code == 0, err
    assert [json.loads(line)["score"] for line in out.splitlines()] == [1.0, 0.0, 1.0]
    assert "trec: 50.0 (n=2)" in err and "passage_count_e: 100.0 (n=1)  0-4k nan  4-8k 100.0  8k+ nan" in err
    code, out, err = score_cli(capsys, str(preds), "--out", str(tmp_path / "scored.jsonl"))
    assert code == 0 and "trec: 50.0 (n=2)" in out
    assert len((tmp_path / "scored.jsonl").read_text().splitlines()) == 3
    # An official per-dataset file has no dataset field: --dataset names it.
    write_rows(preds, [{"pred": "Paragraph 2", "answers": ["Paragraph 2"], "all_classes": None, "length": 1}])
    assert "passage_retrieval_en: 100.0 (n=1)" in score_cli(capsys, str(preds), "--dataset", "passage_retrieval_en")[2]


def test_score_command_bad_input(tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    cases = [
        ([{"dataset": "nope", "pred": "x", "answers": ["x"]}], "line 1: unknown dataset 'nope'; valid: narrativeqa"),
        ([{"pred": "x", "answers": ["x"]}], "line 1: no dataset"),
        ([{"dataset": "trec", "pred": "x", "answers": ["x"]}, "{bad"], "line 2: not valid JSON"),
        ([{"dataset": "trec", "pred": None, "answers": ["x"]}], "needs 'pred'"),
        ([{"dataset": "trec_e", "pred": "x", "answers": ["x"]}], "needs a numeric 'length'"),
        ([], "has no predictions"),
    ]
    for lines, message in cases:
        write_rows(preds, lines)
        code, _out, err = score_cli(capsys, str(preds))
        assert code == 2 and message in err and err.count("\n") == 1, err
    assert "cannot read" in score_cli(capsys, str(tmp_path / "missing.jsonl"))[2]
