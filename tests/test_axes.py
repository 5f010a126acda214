"""The grid's axes (pkvbench/reports/axes.py) directly: each axis's order, a budget's kind, a cell's one label, and
the policy column as a categorical under the installed pandas. No model, no run folder."""

import pandas as pd
import pytest

from pkvbench.errors import PkvError
from pkvbench.reports import axes
from pkvbench.reports.axes import (
    ENTRIES,
    EVERY_ENTRY,
    FRACTION,
    MEMORY_BYTES,
    MEMORY_SHARE,
    REMOVED,
    SERIES,
    Labelled,
    budget_kind,
    budget_point,
    cell_label,
    full_rows,
    key_label,
    of_kind,
    order_axes,
    present,
    series_labels,
    with_query_modes,
)


def rows(**columns) -> pd.DataFrame:
    """Rows with the given columns (lists of one length), the others the paper's cell."""
    length = len(next(iter(columns.values())))
    base = {"model": "m", "task": "needle", "policy": "snapkv", "budget": "64", "query_mode": "aware"}
    return pd.DataFrame({**{k: [v] * length for k, v in base.items()}, **columns})


# --- the orders ------------------------------------------------------------------------------------------------------


def test_each_axis_in_its_order_not_as_written_nor_alphabetically():
    frame = rows(
        policy=["snapkv", "full", "pyramidkv", "streamingllm", "snapkv:window=32", "h2o"],
        budget=["cr0.25", "0.05", "128", "mem0.05", "64", "cr0.5"],
        kv_bits=["4", "16", "2", "32", "8", "native"],
        decode_budget=["64", "none", "8", "none", "128", "none"],
        task=["trec", "narrativeqa", "needle", "qasper", "trec_e", "hotpotqa"],
        query_mode=["agnostic", "aware", "aware", "aware", "aware", "aware"],
    )
    ordered = order_axes(frame)
    assert present(ordered["policy"]) == ["full", "streamingllm", "h2o", "snapkv", "snapkv:window=32", "pyramidkv"]
    # entries ascending, fractions kept ascending, compression ratios by the share kept, then memory as it comes
    assert present(ordered["budget"]) == ["64", "128", "0.05", "cr0.5", "cr0.25", "mem0.05"]
    assert present(ordered["kv_bits"]) == ["native", "32", "16", "8", "4", "2"]  # widest first
    assert present(ordered["decode_budget"]) == ["none", "8", "64", "128"]  # no cut first
    assert present(ordered["task"]) == ["narrativeqa", "qasper", "hotpotqa", "trec", "trec_e", "needle"]  # LongBench's
    assert present(ordered["query_mode"]) == ["aware", "agnostic"]  # the paper's first
    assert list(frame["budget"]) == ["cr0.25", "0.05", "128", "mem0.05", "64", "cr0.5"]  # the rows are not changed


def test_series_are_ordered_by_policy_then_bits_then_decode_budget():
    frame = rows(
        policy=["snapkv", "snapkv", "full", "snapkv", "full"],
        kv_bits=["4", "16", "4", "16", "16"],
        decode_budget=["none", "32", "32", "none", "none"],
    )
    ordered = order_axes(frame)
    assert list(ordered[SERIES].cat.categories) == [
        "full · 16 bits",
        "full · 4 bits",
        "snapkv · 16 bits",
        "snapkv · 16 bits · decode 32",
        "snapkv · 4 bits",
    ]


def test_a_query_agnostic_line_follows_its_query_aware_line():
    ordered = with_query_modes(
        order_axes(rows(policy=["snapkv", "full", "snapkv"], query_mode=["agnostic"] * 2 + ["aware"]))
    )
    assert list(ordered[SERIES].cat.categories) == ["full (agnostic)", "snapkv", "snapkv (agnostic)"]


# --- a budget's kind -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "label,kind,value",
    [
        ("128", ENTRIES, 128.0),
        ("1", ENTRIES, 1.0),
        ("0.05", FRACTION, 0.05),
        ("cr0.25", REMOVED, 0.25),
        ("cr0", REMOVED, 0.0),
        ("all", EVERY_ENTRY, 1.0),
        ("mem0.05", MEMORY_SHARE, 0.05),
        ("mem2MiB", MEMORY_BYTES, 2 * 2**20),
    ],
)
def test_a_budget_label_has_one_kind_and_a_place_on_its_number_line(label, kind, value):
    assert budget_kind(label) == kind
    assert budget_point(label) == (kind, value)


def test_a_label_that_is_no_budget_is_refused_and_sorts_last():
    with pytest.raises(PkvError):
        budget_kind("*")  # the gate's row pooled over budgets
    assert axes.budget_sort_key("*") > axes.budget_sort_key("cr0.01") > axes.budget_sort_key("0.9")


def test_budgets_of_a_kind_are_a_plain_boolean_column():
    budgets = order_axes(rows(budget=["64", "mem0.05", "0.1"]))["budget"]  # an ordered categorical
    memory = of_kind(budgets, MEMORY_SHARE, MEMORY_BYTES)
    assert memory.dtype == bool and list(~memory) == [True, False, True]


# --- the label -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cell,label",
    [
        ({"policy": "snapkv"}, "snapkv"),
        ({"policy": "snapkv", "kv_bits": "4"}, "snapkv · 4 bits"),
        ({"policy": "snapkv", "kv_bits": "4 g64 r32"}, "snapkv · 4 g64 r32 bits"),
        ({"policy": "snapkv", "decode_budget": "64"}, "snapkv · decode 64"),
        ({"policy": "snapkv", "kv_bits": "2", "decode_budget": "64"}, "snapkv · 2 bits · decode 64"),
        ({"decode_budget": "64", "kv_bits": "2", "policy": "snapkv"}, "snapkv · 2 bits · decode 64"),  # one order
        # the paper's setting goes unsaid: no cut while decoding, the model's own cache (the key's "")
        ({"policy": "snapkv", "kv_bits": "", "decode_budget": "none"}, "snapkv"),
        ({"policy": "snapkv", "kv_bits": float("nan"), "decode_budget": None}, "snapkv"),
        # a storage format's own name stands alone; a width is in bits
        ({"policy": "snapkv", "kv_bits": "fp8"}, "snapkv · fp8"),
        ({"policy": "full", "kv_bits": "native"}, "full · native bits"),
        # what a label does not name: the budget (unless asked), the task, the query mode
        ({"policy": "snapkv", "budget": "128", "task": "qa", "query_mode": "agnostic"}, "snapkv"),
    ],
)
def test_a_cell_is_labelled_one_way(cell, label):
    assert cell_label(cell) == label


def test_with_its_budget_and_as_the_store_keys_it():
    cell = {"policy": "snapkv", "budget": "128", "kv_bits": "16", "kv_stored": "4", "decode_budget": "32"}
    assert cell_label(cell, at_budget=True) == "snapkv · 16 bits · decode 32 @ 128"
    assert key_label(cell, at_budget=True) == "snapkv · 4 bits · decode 32 @ 128"  # the key's storage, kv_stored
    assert key_label({"policy": "full", "budget": "64", "kv_stored": "", "decode_budget": "none"}) == "full"


def test_a_line_names_the_bits_only_where_the_rows_have_several_and_the_full_cache_never_its_decode_budget():
    one_width = rows(policy=["snapkv", "full"], kv_bits=["16", "16"], decode_budget=["32", "32"])
    assert series_labels(one_width) == ["snapkv · decode 32", "full"]
    two_widths = rows(policy=["snapkv", "full"], kv_bits=["16", "4"], decode_budget=["32", "32"])
    assert series_labels(two_widths) == ["snapkv · 16 bits · decode 32", "full · 4 bits"]


def test_a_new_axis_is_one_entry(monkeypatch):
    """A grid axis added later (a conversation's turn) names itself in every label by one entry of ``LABELLED``."""
    monkeypatch.setitem(axes.LABELLED, "turn", Labelled("turn {}".format, unsaid=("1",)))
    assert cell_label({"policy": "snapkv", "kv_bits": "4", "turn": "3"}, at_budget=False) == "snapkv · 4 bits · turn 3"
    assert cell_label({"policy": "snapkv", "turn": "1"}) == "snapkv"
    assert series_labels(rows(policy=["snapkv", "full"], turn=["2", "2"])) == ["snapkv · turn 2", "full · turn 2"]


# --- the full cache --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policies", [["full"], ["snapkv"], ["full", "snapkv"], ["full", "snapkv", "h2o"]])
def test_the_full_cache_rows_are_a_plain_boolean_column_whatever_the_policies(policies):
    """Issue 47 R2: ``.map(is_full)`` over the ordered categorical ``load_runs`` makes is a categorical under pandas
    3 where the map is one-to-one, and ``~`` on it fails; ``full_rows`` is a boolean column for every policy set."""
    column = order_axes(rows(policy=policies))["policy"]
    full = full_rows(column)
    assert full.dtype == bool
    assert list(~full) == [p != "full" for p in policies]
    assert list(full & ~full) == [False] * len(policies)
    labelled = full_rows(pd.Series(["full · 4 bits", "full (agnostic)", "fullish", "snapkv"]))
    assert list(labelled) == [True, True, False, False]
