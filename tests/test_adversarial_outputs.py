"""Issue 40, the third adversarial round: its results, gate and data half (N2–N7, N10, N12, round 2's W6). Each
test is a case a hostile user tried on main at 51430f3 that went wrong then."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pkvbench.cell.fingerprints import fingerprint
from pkvbench.errors import PkvError
from pkvbench.metrics.functions import final_number
from pkvbench.reports.report import to_latex, to_markdown
from pkvbench.store.results import ResultStore
from pkvbench.tasks.base import Sample, TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.test_cli import pkvbench_in_process

RUNS = Path(__file__).parent / "fixtures" / "runs"


@pytest.mark.parametrize(
    "prediction, number",
    [
        ("\\boxed{1{,}250}", "1250"),  # N5: TeX's thousands separators, not "250"
        ("\\boxed{1\\,250}", "1250"),
        ("\\boxed{12\\,345\\,678}", "12345678"),
        ("\\boxed{\u22125}", "-5"),  # the Unicode minus, not 5
        ("\\boxed 5 and then {10}", "5"),  # \boxed without braces takes its own word, not a later group
        ("\\boxed 1{,}250.", "1250"),
        ("In 4 weeks: 5\u202f000 pens", "5000"),  # a narrow no-break space between thousands
        ("pages 3\u20135", "5"),  # an en dash is no minus sign
    ],
)
def test_boxed_answers_read_tex_separators_and_the_unicode_minus(prediction, number):
    assert final_number(prediction) == number


def _write_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            ["test/a.json", "test/a.json"],
            r"math500.jsonl, line 2: the sample id 'test/a.json' again \(.*line 1 has it\)",
        ),
        ([None, None], r"math500.jsonl, line 1: the id 'unique_id' must be a string or a whole number, got None"),
    ],
)
def test_a_reasoning_file_with_an_id_twice_is_refused_naming_the_line(tmp_path, ids, message):
    """N4: the second problem of an id ran and then vanished ("1 rows written, 2 prefills")."""
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1), "unique_id": id_} for i, id_ in enumerate(ids)]
    _write_lines(tmp_path / "math500.jsonl", rows)
    with pytest.raises(PkvError, match=message):
        build_samples(get_task("math500"), None, TaskOptions(data_dir=str(tmp_path)))  # refused before tokenizing


def test_a_longbench_file_with_an_id_twice_is_refused_naming_the_line(tmp_path):
    row = {"input": "q?", "context": "c", "answers": ["a"], "length": 10, "all_classes": None, "_id": "x1"}
    _write_lines(tmp_path / "narrativeqa.jsonl", [row, {**row, "_id": "x2"}, row])
    with pytest.raises(PkvError, match=r"narrativeqa.jsonl, line 3: the sample id 'x1' again"):
        build_samples(get_task("narrativeqa"), None, TaskOptions(data_dir=str(tmp_path), verify=False))


def test_a_generator_that_makes_an_id_twice_is_refused():
    from pkvbench.tasks.base import refuse_repeated_samples

    sample = Sample.one_question("s0", [1, 2, 3], 2, ["a"])
    with pytest.raises(PkvError, match="mine: two samples have the id 's0'"):
        refuse_repeated_samples("mine", [sample, sample])


def test_latex_writes_a_backslash_as_one_and_markdown_keeps_a_pipe_inside_its_cell():
    """Round 2's W6: ``\\textbackslash\\{\\}`` printed ``\\{}``; a ``|`` in a model name split the row."""
    table = pd.DataFrame({"model": ["C:\\models\\a|b"], "policy": ["snapkv_{x}"], "score": [50.0]})
    latex = to_latex(table)
    assert r"C:\textbackslash{}models\textbackslash{}a\textbar{}b & snapkv\_\{x\} & 50.00 \\" in latex
    markdown = to_markdown(table).splitlines()
    assert markdown[2] == "| C:\\models\\a\\|b | snapkv_{x} | 50.00 |"
    assert all(line.replace("\\|", "").count("|") == 4 for line in markdown)  # 3 cells in every line


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "{html}"], "--html and --out are both .*page.html: the table would overwrite the page"),
        (["--view", "frontier"], "--view shapes the table, and with --html alone there is none"),
        (["--format", "latex"], "--format shapes the table"),
    ],
)
def test_report_html_refuses_its_own_path_twice_and_table_options_it_would_ignore(tmp_path, capsys, extra, message):
    """N7: the page was written, then overwritten by the Markdown table, exit 0; --view and --format were ignored."""
    html = tmp_path / "page.html"
    args = [a.replace("{html}", str(html)) for a in extra]
    code, _, err = pkvbench_in_process(capsys, "report", str(RUNS / "needle_a"), "--html", str(html), *args)
    assert code == 2 and re.search(message, err) and len(err.strip().splitlines()) == 1
    assert not html.exists()  # nothing written


def make_run(folder, rows, options=None):
    """A run folder holding ``rows`` (each a result row's fields beyond the defaults below)."""
    store = ResultStore(folder)
    store.open({"options": {"model": "smollm2-135m", **(options or {})}}, overwrite=True)
    for row in rows:
        store.append({"task": "needle", "model": "smollm2-135m", "policy": "snapkv", "budget": 64, **row})
    return str(folder)


def stored(bits, **row):
    """A row whose cache was stored in ``bits`` (a ``--kv-bits`` run: not the model's own cache)."""
    return {"kv_native": False, "kv_bits": bits, "kv_group": 32, "kv_residual": 128, **row}


def test_export_of_rows_without_the_fields_the_schema_does_not_require(tmp_path, capsys):
    """N10: rows without budget_tokens or context_tokens (or pred, answers) were a KeyError in export."""
    rows = [{"sample_id": f"s{i}", "score": i / 2, "budget": budget} for i in range(2) for budget in (64, 0.25)]
    code, _, err = pkvbench_in_process(
        capsys, "export", make_run(tmp_path / "run", rows), "--out", str(tmp_path / "out")
    )
    assert code in (0, None), err
    folders = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert folders == ["needle__data__SmolLM2-135M-Instruct__pkvbench_snapkv__0.75__query_aware",
                       "needle__data__SmolLM2-135M-Instruct__pkvbench_snapkv__budget64__query_aware"]  # fmt: skip
    predictions = pd.read_csv(tmp_path / "out" / folders[0] / "predictions.csv")
    assert list(predictions["sample_id"]) == ["s0", "s1"] and predictions["context_tokens"].isna().all()


def test_export_keeps_storage_formats_in_folders_of_their_own(tmp_path, capsys):
    """N3: a --kv-bits 16,4 run's two formats were written into one kvpress folder (n doubled)."""
    common = {"budget_tokens": 64, "context_tokens": 256}
    rows = [stored(bits, sample_id=f"s{i}", score=float(bits == 16), **common) for bits in (16, 4) for i in range(2)]
    code, _, err = pkvbench_in_process(
        capsys, "export", make_run(tmp_path / "run", rows), "--out", str(tmp_path / "out")
    )
    assert code in (0, None), err
    folders = sorted(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert [p.name.split("__")[3] for p in folders] == ["pkvbench_snapkv-kv16", "pkvbench_snapkv-kv4"]
    scores = [json.loads((p / "metrics.json").read_text())["needle"]["string_match"] for p in folders]
    assert scores == [100.0, 0.0] and all(len(pd.read_csv(p / "predictions.csv")) == 2 for p in folders)
    ranking = pd.read_csv(tmp_path / "out" / "ranking.csv")
    assert sorted(ranking["policy"]) == ["snapkv · 16 bits", "snapkv · 4 bits"]


def _fingerprinted(seed, **row):
    kept = [
        [np.random.default_rng(seed + layer).choice(100, size=8, replace=False) for _ in range(2)] for layer in range(3)
    ]
    return {**row, "kept_fingerprint": fingerprint(kept)}


def test_check_refuses_a_baseline_whose_samples_file_names_samples_the_run_does_not_have(tmp_path, capsys):
    """N2: the samples file's ids renamed (counts and means still the baseline's): the paired tests and the kept-set
    comparison matched nothing, and a run whose every kept set changed passed, printing "paired tests on"."""
    rows = [_fingerprinted(i, sample_id=f"s{i}", score=1.0, pred="a") for i in range(3)]
    baseline = tmp_path / "base.csv"
    code, _, err = pkvbench_in_process(
        capsys, "check", "--baseline", str(baseline), "--results", make_run(tmp_path / "b", rows), "--update"
    )
    assert code in (0, None), err
    samples = tmp_path / "base.samples.csv"
    true = samples.read_text()
    samples.write_text(true.replace(",s0,", ",x0,").replace(",s1,", ",x1,").replace(",s2,", ",x2,"))  # others
    changed = make_run(
        tmp_path / "r", [_fingerprinted(100 + i, sample_id=f"s{i}", score=1.0, pred="a") for i in range(3)]
    )
    code, out, err = pkvbench_in_process(capsys, "check", "--baseline", str(baseline), "--results", changed)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    assert re.search(
        r"base.samples.csv, row 1 \(needle snapkv 64 aware x0\): the run's cell has 3 samples, as the baseline's, but not this one \(3 of 3 differ\)",
        err,
    )
    # and with the true samples file, the same run fails on its kept sets, saying how many it compared
    samples.write_text(true)
    code, _, err = pkvbench_in_process(capsys, "check", "--baseline", str(baseline), "--results", changed)
    assert code == 1 and "kept sets of 3 samples in 1 cells (3 a cell): 1 CHANGED" in err
    assert "paired tests on 3 samples in 1 cells (3 a cell)" in err


def test_check_keeps_storage_formats_and_decode_budgets_apart(tmp_path, capsys):
    """N3: ``check --update`` on a --kv-bits 16,4 run pooled both formats into one cell (n doubled) and then refused
    the baseline it had written ("a sample written twice"); the decode budget is a cell's as well."""
    rows = [stored(bits, sample_id=f"s{i}", score=float(bits == 16)) for bits in (16, 4) for i in range(2)]
    rows += [{"sample_id": f"s{i}", "score": 0.5, "decode_budget": 32} for i in range(2)]  # the model's own cache
    run = make_run(tmp_path / "run", rows)
    baseline = tmp_path / "base.csv"
    code, _, err = pkvbench_in_process(capsys, "check", "--baseline", str(baseline), "--results", run, "--update")
    assert code in (0, None), err
    cells = pd.read_csv(baseline, keep_default_na=False)
    assert sorted(zip(cells["kv_stored"].astype(str), cells["decode_budget"].astype(str), cells["n"])) == [
        ("", "32", 2), ("16", "none", 2), ("4", "none", 2)]  # fmt: skip
    code, out, err = pkvbench_in_process(capsys, "check", "--baseline", str(baseline), "--results", run)
    assert code in (0, None) and out.startswith("check passed: 3 cells (3 ok)"), out + err


def test_a_baseline_of_one_format_does_not_pass_rows_of_another(tmp_path, capsys):
    """N3: a baseline of 4-bit rows passed 16-bit rows as the same cells."""
    four = make_run(tmp_path / "four", [stored(4, sample_id=f"s{i}", score=1.0) for i in range(2)])
    sixteen = make_run(tmp_path / "sixteen", [stored(16, sample_id=f"s{i}", score=1.0) for i in range(2)])
    baseline = str(tmp_path / "base.csv")
    assert pkvbench_in_process(capsys, "check", "--baseline", baseline, "--results", four, "--update")[0] in (0, None)
    code, _, err = pkvbench_in_process(capsys, "check", "--baseline", baseline, "--results", sixteen)
    assert code == 1 and "1 missing" in err and "1 new" in err


def test_an_old_baseline_without_the_format_columns_reads_as_the_models_own_cache(tmp_path, capsys):
    run = make_run(tmp_path / "run", [{"sample_id": f"s{i}", "score": 1.0} for i in range(2)])
    baseline = tmp_path / "base.csv"
    baseline.write_text(
        "model,task,policy,budget,n,score,ci_low,ci_high\nsmollm2-135m,needle,snapkv,64,2,100,100,100\n"
    )
    code, out, err = pkvbench_in_process(capsys, "check", "--baseline", str(baseline), "--results", run)
    assert code in (0, None) and out.startswith("check passed: 1 cells (1 ok)"), out + err


def test_merge_refuses_shards_of_two_splits(tmp_path, capsys):
    """N6: ``1/2`` merged with ``3/3`` was accepted."""
    first = make_run(tmp_path / "a", [{"sample_id": "s0", "score": 1.0}], {"shard": "1/2"})
    other = make_run(tmp_path / "b", [{"sample_id": "s2", "score": 1.0}], {"shard": "3/3"})
    code, _, err = pkvbench_in_process(capsys, "merge", first, other, "--out", str(tmp_path / "m"))
    assert code == 2 and "is a shard of a split into 3" in err and "merge the shards of one split" in err
    assert not (tmp_path / "m").exists()


def test_a_merge_of_one_shard_of_two_says_and_records_that_it_is_not_the_whole_run(tmp_path, capsys):
    """N6: a merge of one shard of two looked like a complete run."""
    first = make_run(tmp_path / "a", [{"sample_id": "s0", "score": 1.0}], {"shard": "1/2"})
    code, _, err = pkvbench_in_process(capsys, "merge", first, "--out", str(tmp_path / "m"))
    assert code in (0, None) and "shards 2/2 are missing: " in err
    assert json.loads((tmp_path / "m" / "run.json").read_text())["shards"] == {
        "count": 2,
        "merged": [1],
        "missing": [2],
    }
    code, _, err = pkvbench_in_process(capsys, "report", str(tmp_path / "m"))
    assert code in (0, None) and "a merge without shards 2/2: not the whole run" in err
    # the other shard merged in: whole
    second = make_run(tmp_path / "b", [{"sample_id": "s1", "score": 1.0}], {"shard": "2/2"})
    code, _, err = pkvbench_in_process(capsys, "merge", str(tmp_path / "m"), second, "--out", str(tmp_path / "whole"))
    assert code in (0, None) and "missing" not in err
    assert json.loads((tmp_path / "whole" / "run.json").read_text())["shards"]["missing"] == []


def test_a_file_whose_record_cannot_be_written_is_refused_before_it_is_written(tmp_path, capsys):
    """N12: with .pkvbench-outputs.json a folder, the report was written and the command then exited 2; a rerun
    refused pkvbench's own report."""
    (tmp_path / ".pkvbench-outputs.json").mkdir()
    table = tmp_path / "table.md"
    code, _, err = pkvbench_in_process(capsys, "report", str(RUNS / "needle_a"), "--out", str(table))
    assert code == 2 and ".pkvbench-outputs.json is not a file" in err and len(err.strip().splitlines()) == 1
    assert not table.exists()
