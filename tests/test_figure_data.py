"""The numbers both renderers draw (pkvbench/reports/figures/figure_data.py), on hand-made rows: no model, no plotting library."""

import subprocess
import sys

import pandas as pd
import pytest

from pkvbench.reports.axes import order_axes
from pkvbench.reports.figures.figure_data import full_reference, needle_cells


def rows(*records):
    columns = ["model", "task", "policy", "budget", "kv_bits", "query_mode", "sample_id", "score"]
    return order_axes(pd.DataFrame([dict(zip(columns, r)) for r in records]))  # as report.load_runs gives them


def test_the_full_reference_counts_each_sample_once_and_is_the_widest_cache():
    table = rows(
        # the full cache run at two budgets: the same two samples, each counted once
        ("m", "qa", "full · 16 bits", "64", "16", "aware", "a", 1.0),
        ("m", "qa", "full · 16 bits", "128", "16", "aware", "a", 1.0),
        ("m", "qa", "full · 16 bits", "64", "16", "aware", "b", 0.5),
        # KIVI alone (the full cache at 2 bits) is a compressed point, not the reference
        ("m", "qa", "full · 2 bits", "64", "2", "aware", "a", 0.0),
        ("m", "qa", "full · 2 bits", "64", "2", "aware", "b", 0.0),
        ("m", "qa", "snapkv · 16 bits", "64", "16", "aware", "a", 0.0),
    )
    assert full_reference(table, "qa") == (75.0, 2)


def test_the_full_reference_keeps_to_a_query_mode_and_averages_tasks_only_when_each_has_one():
    table = rows(
        ("m", "qa", "full", "64", "16", "aware", "a", 1.0),
        ("m", "qa", "full", "64", "16", "agnostic", "a", 0.0),
        ("m", "sum", "full", "64", "16", "aware", "c", 0.5),
        ("m", "sum", "snapkv", "64", "16", "agnostic", "c", 0.25),
    )
    assert full_reference(table, "qa", "agnostic") == (0.0, 1)
    assert full_reference(table, "qa") == (100.0, 1)  # several modes, none named: the default (aware)
    assert full_reference(table, "avg", "aware")[0] == pytest.approx(75.0)
    assert full_reference(table, "avg", "agnostic") is None  # "sum" has no agnostic full cache
    assert full_reference(table, "missing") is None


def test_needle_squares_hold_the_mean_and_the_count():
    table = pd.DataFrame(
        {
            "policy": ["snapkv"] * 3 + ["h2o"],
            "length": [1000, 1000, 2000, 1000],
            "depth": [50, 50, 50, 50],
            "score": [1.0, 0.0, 0.5, 0.25],
        }
    )
    squares = needle_cells(table, ["policy"]).set_index(["policy", "length"])
    assert squares.loc[("snapkv", 1000), "score"] == 0.5 and squares.loc[("snapkv", 1000), "n"] == 2
    assert squares.loc[("snapkv", 2000), "n"] == 1 and squares.loc[("h2o", 1000), "score"] == 0.25


def test_the_html_report_needs_no_plotting_library():
    # The page is Vega-Lite; its colours come from figure_data, so matplotlib and seaborn stay unloaded.
    code = "import sys, pkvbench.reports.html_report; print(sorted({'matplotlib', 'seaborn'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
