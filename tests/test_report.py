"""`pkvbench report` and `compare` on hand-made run folders (tests/fixtures/runs, see make_fixtures.py). No model."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from pkvbench.errors import PkvError
from pkvbench.reports.paper_compare import compare, load_reference
from pkvbench.reports.report import (
    length_bucket,
    load_runs,
    render,
    report_table,
    uneven_counts,
)

RUNS = Path(__file__).parent / "fixtures" / "runs"
NEEDLE, MORE, LONG = RUNS / "needle_a", RUNS / "needle_more", RUNS / "longbench_llama"
LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
REFERENCE_CSV = Path(__file__).parents[1] / "results" / "reference" / "pyramidkv_table1.csv"


def cell(table, model, policy, budget, column):
    row = table[(table["model"] == model) & (table["policy"] == policy) & (table["budget"] == budget)]
    assert len(row) == 1, (model, policy, budget)
    return row.iloc[0][column]


def test_needle_cells_are_mean_scores_times_100():
    table = report_table(load_runs([NEEDLE]).rows)
    assert list(table.columns) == ["model", "policy", "budget", "needle", "avg", "tasks", "n"]
    assert cell(table, "smollm2-135m", "full", "64", "needle") == 91.67
    assert cell(table, "smollm2-135m", "snapkv", "0.05", "needle") == 25.0
    assert cell(table, "smollm2-135m", "pyramidkv", "64", "needle") == 33.33
    assert cell(table, "smollm2-135m", "pyramidkv", "64", "avg") == 33.33  # one task: avg is that task
    assert cell(table, "smollm2-135m", "snapkv", "64", "n") == 6
    # rows: policies in the canonical order, token budgets before fractions
    assert list(zip(table["policy"], table["budget"])) == [
        ("full", "64"),
        ("full", "0.05"),
        ("snapkv", "64"),
        ("snapkv", "0.05"),
        ("pyramidkv", "64"),
        ("pyramidkv", "0.05"),
    ]


def test_average_is_plain_mean_over_tasks_and_missing_cells_stay_missing():
    table = report_table(load_runs([LONG]).rows)
    assert [c for c in table.columns if " " not in c][3:] == ["narrativeqa", "hotpotqa_e", "trec", "avg", "tasks", "n"]
    assert cell(table, LLAMA, "full", "128", "avg") == pytest.approx((30 + 50 + 50) / 3, abs=0.005)
    assert cell(table, LLAMA, "snapkv", "128", "avg") == pytest.approx(46.67, abs=0.005)
    # pyramidkv never ran trec: the cell is missing (not 0) and so is its average
    assert math.isnan(cell(table, LLAMA, "pyramidkv", "128", "trec"))
    assert math.isnan(cell(table, LLAMA, "pyramidkv", "128", "avg"))
    assert cell(table, LLAMA, "pyramidkv", "128", "tasks") == 2
    assert cell(table, LLAMA, "h2o", "128", "hotpotqa_e") == 10.0  # a real 0 sample stays a score


def test_longbench_e_buckets():
    table = report_table(load_runs([LONG]).rows)
    assert cell(table, LLAMA, "full", "128", "hotpotqa_e 0-4k") == 30.0
    assert cell(table, LLAMA, "full", "128", "hotpotqa_e 4-8k") == 50.0
    assert cell(table, LLAMA, "full", "128", "hotpotqa_e 8k+") == 70.0
    assert cell(table, LLAMA, "h2o", "128", "hotpotqa_e 0-4k") == 0.0
    # only *_e tasks get buckets, even though narrativeqa and trec rows carry a length
    assert not any(c.startswith(("narrativeqa ", "trec ")) for c in table.columns)
    assert [length_bucket(x) for x in (0, 3999, 4000, 7999, 8000, 30000, None)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
        None,
    ]


def test_merge_counts_overlap_once_and_keeps_each_models_average():
    runs = load_runs([NEEDLE, MORE, LONG])
    assert any("12 rows found in more than one folder" in note for note in runs.notes)
    table = report_table(runs.rows)
    assert cell(table, "smollm2-135m", "full", "64", "n") == 6  # not 12
    assert cell(table, "smollm2-135m", "streamingllm", "64", "needle") == 10.0  # only in needle_more
    assert math.isnan(cell(table, "smollm2-135m", "full", "64", "trec"))
    # averages run over each model's own tasks: the Llama rows are not blanked by the needle column
    assert cell(table, LLAMA, "full", "128", "avg") == pytest.approx(43.33, abs=0.005)
    assert cell(table, "smollm2-135m", "full", "64", "avg") == 91.67
    # a folder above run folders is searched
    assert len(report_table(load_runs([RUNS]).rows)) == len(table)


def test_uneven_sample_counts_are_noted(tmp_path):
    rows = [json.loads(line) for line in (NEEDLE / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not (r["policy"] == "snapkv" and r["budget"] == 64 and r["depth"] == 100.0)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    notes = uneven_counts(load_runs([tmp_path]).rows)
    assert notes == ["needle: smollm2-135m snapkv @ 64 has 4 samples, others up to 6"]


def test_formats_show_missing_as_missing():
    table = report_table(load_runs([LONG]).rows)
    markdown = render(table, "markdown")
    pyramid = next(line for line in markdown.splitlines() if "| pyramidkv |" in line)
    assert pyramid.count("—") == 2 and " 0.00 " not in pyramid
    assert markdown.splitlines()[1].startswith("|---|---|---|---:")
    csv = render(table, "csv")
    assert "pyramidkv,128,30.00,30.00,40.00,40.00,10.00,,,2,5" in csv
    back = pd.read_csv(pd.io.common.StringIO(csv))
    assert back["trec"].isna().sum() == 1
    latex = render(table, "latex")
    assert r"\begin{tabular}" in latex and r"hotpotqa\_e" in latex and "& -- &" in latex


def test_report_cli_writes_the_file(tmp_path, capsys):
    from pkvbench.cli import main

    out = tmp_path / "t" / "table.csv"
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(NEEDLE), str(LONG), "--format", "csv", "--out", str(out)])
    assert exit_info.value.code == 0
    assert out.read_text().startswith("model,policy,budget,narrativeqa,")


@pytest.mark.parametrize(
    "args,expected",
    [
        (["report", "/nonexistent/x"], "/nonexistent/x: no such folder"),
        (["report", str(Path(__file__).parents[1] / "pkvbench")], "not a run folder"),
        (["report", str(NEEDLE), "--format", "html"], "html"),
        (["compare", str(NEEDLE)], "nothing to compare: the run's tasks (needle)"),
        (["compare", str(LONG), "--reference", "table9"], "unknown reference 'table9'"),
        (["compare", str(LONG), "--paper-model", "GPT-5"], "unknown paper model 'GPT-5'"),
    ],
)
def test_bad_input_is_one_line(args, expected, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code != 0
    assert len(err) == 1 and expected in err[0], err


# --- the reference table and compare ---------------------------------------------------------------------------------


def test_reference_is_the_papers_table_with_the_mistral_caveat():
    ref = load_reference("pyramidkv-table1")
    assert ref.models == ["Llama-3-8B-Instruct", "Mistral-7B-Instruct"]
    assert len(ref.scores) == 18 * 16 and ref.scores["task"].nunique() == 16
    flagged = {(r.model, r.policy, r.budget) for r in ref.average_mismatches().itertuples()}
    assert flagged == {
        ("Mistral-7B-Instruct", "full", "full"),
        ("Mistral-7B-Instruct", "streamingllm", "128"),
        ("Mistral-7B-Instruct", "h2o", "128"),
        ("Mistral-7B-Instruct", "snapkv", "2048"),
    }
    means = ref.row_means().set_index(["model", "policy", "budget"])
    assert means.loc[("Mistral-7B-Instruct", "full", "full"), "row_mean"] == pytest.approx(41.13, abs=0.005)
    assert means.loc[("Llama-3-8B-Instruct", "pyramidkv", "128"), "average"] == 37.25


def test_compare_with_the_reference_csv():
    ref_csv = pd.read_csv(REFERENCE_CSV, dtype={"budget": str})
    paper = ref_csv[ref_csv["model"] == "Llama-3-8B-Instruct"].set_index(["policy", "budget", "task"])["score"]
    result = compare(load_runs([LONG]), load_reference("pyramidkv-table1"))
    t = result.table.set_index(["policy", "budget", "task"])
    # full at any run budget is the paper's full cache
    assert t.loc[("full", "full", "narrativeqa"), "paper"] == paper[("full", "full", "narrativeqa")] == 25.70
    assert t.loc[("full", "full", "narrativeqa"), "measured"] == 30.0
    assert t.loc[("full", "full", "narrativeqa"), "delta"] == pytest.approx(4.30)
    assert t.loc[("snapkv", "128", "trec"), "delta"] == pytest.approx(100 - paper[("snapkv", "128", "trec")])
    # the average compares means over the tasks both have (2 here), not the paper's 16-task average
    avg = t.loc[("full", "full", "average (2 of 16 tasks)")]
    assert avg["measured"] == 40.0
    assert avg["paper"] == pytest.approx((25.70 + 73.00) / 2, abs=0.005)
    # hotpotqa_e is not hotpotqa; pyramidkv lacks trec: only its narrativeqa is compared
    assert "hotpotqa_e" not in set(result.table["task"])
    assert ("pyramidkv", "128", "trec") not in t.index
    assert ("pyramidkv", "128", "average (1 of 16 tasks)") in t.index
    # the run's model is the paper's: no model statement; default h2o is not the paper's H2O: said
    assert not any("not the paper's:" in s for s in result.statements)
    assert any(s.startswith("h2o: run has scores=all, the paper scores=window") for s in result.statements)
    assert set(result.table["paper_model"]) == {"Llama-3-8B-Instruct"}


def test_compare_states_plainly_that_the_model_differs(tmp_path):
    rows = [json.loads(line) for line in (LONG / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        r["model"] = "smollm2-135m"
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = compare(load_runs([tmp_path]), load_reference("pyramidkv-table1"))
    assert any(
        "The run's model (SmolLM2-135M-Instruct) is not the paper's" in s and "Llama-3-8B-Instruct" in s
        for s in result.statements
    )
    mistral = compare(load_runs([tmp_path]), load_reference("pyramidkv-table1"), paper_model="Mistral-7B-Instruct")
    assert set(mistral.table["paper_model"]) == {"Mistral-7B-Instruct"}
    # comparing with Mistral brings its printed-average caveat along
    assert any(
        "Mistral-7B-Instruct full @ full prints average 39.75 but its 16 task scores average 41.13" in s
        for s in mistral.statements
    )


def test_compare_cli_prints_the_statement_first(tmp_path, capsys):
    from pkvbench.cli import main

    rows = [json.loads(line) for line in (LONG / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        r["model"] = "smollm2-135m"
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(tmp_path), "--reference", "pyramidkv-table1"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: The run's model (SmolLM2-135M-Instruct) is not the paper's")
    assert any(
        line.startswith(
            "| SmolLM2-135M-Instruct | Llama-3-8B-Instruct | full | full | narrativeqa | 30.00 | 20.00 | 40.00 | 25.70 "
            "| 4.30 | inside |"
        )
        for line in out
    )


def test_budget_not_in_the_paper_is_nothing_to_compare(tmp_path):
    rows = [json.loads(line) for line in (LONG / "samples.jsonl").read_text().splitlines()]
    rows = [{**r, "budget": 64} for r in rows if r["policy"] != "full"]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PkvError, match="none of the run's policy × budget cells"):
        compare(load_runs([tmp_path]), load_reference("pyramidkv-table1"))
