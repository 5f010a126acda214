import json

import pytest

from pkvbench.errors import PkvError
from pkvbench.reports.summary import summarize
from pkvbench.store.results import ResultStore, read_rows


def row(sample, policy="snapkv", budget=128, score=0.5):
    return {"task": "needle", "sample_id": sample, "policy": policy, "budget": budget, "score": score}


def test_append_resume_and_summary(tmp_path):
    store = ResultStore(tmp_path / "run")
    store.open({"options": {"a": 1}})
    store.append(row("s1", score=1.0))
    store.append(row("s2", score=0.5))
    store.append(row("s1", policy="full", budget=0.12, score=0.25))
    again = ResultStore(tmp_path / "run")
    again.open({"options": {"a": 1}})
    assert again.done_keys() == {
        ("needle", "s1", "snapkv", "128", "aware"),
        ("needle", "s2", "snapkv", "128", "aware"),
        ("needle", "s1", "full", "0.12", "aware"),
    }
    table = again.write_summary(summarize(again.rows()))
    assert table.to_dict("records") == [
        # two samples: a resample's mean is one of 50, 75, 100, so the interval spans the two scores
        {
            "task": "needle",
            "policy": "snapkv",
            "budget": "128",
            "n": 2,
            "score": 75.0,
            "ci_low": 50.0,
            "ci_high": 100.0,
        },
        # one sample: nothing to resample, the interval is the point
        {"task": "needle", "policy": "full", "budget": "0.12", "n": 1, "score": 25.0, "ci_low": 25.0, "ci_high": 25.0},
    ]
    header = (tmp_path / "run" / "summary.csv").read_text().splitlines()[0]
    assert header == "task,policy,budget,n,score,ci_low,ci_high"


def test_partial_last_line_is_dropped(tmp_path):
    store = ResultStore(tmp_path)
    store.open({"options": {}})
    store.append(row("s1"))
    with open(store.rows_path, "a") as handle:
        handle.write('{"task": "needle", "sample_id": "s2", "pol')  # a kill mid-write
    assert len(read_rows(tmp_path)) == 1
    ResultStore(tmp_path).open({"options": {}})
    store.append(row("s3"))
    assert [r["sample_id"] for r in read_rows(tmp_path)] == ["s1", "s3"]


def test_other_options_are_refused_unless_overwrite(tmp_path):
    ResultStore(tmp_path / "r").open({"options": {"budgets": [128]}})
    ResultStore(tmp_path / "r").append(row("s1"))
    with pytest.raises(PkvError, match="budgets"):
        ResultStore(tmp_path / "r").open({"options": {"budgets": [64]}})
    fresh = ResultStore(tmp_path / "r")
    fresh.open({"options": {"budgets": [64]}}, overwrite=True)
    assert fresh.rows() == []
    assert json.loads((tmp_path / "r" / "run.json").read_text())["options"] == {"budgets": [64]}


def test_summary_of_nothing_has_columns():
    assert list(summarize([]).columns) == ["task", "policy", "budget", "n", "score", "ci_low", "ci_high"]
