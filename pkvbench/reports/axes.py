"""The grid's axes, ordered and labelled once: when ``report.load_runs`` reads the rows, each axis column (policy,
budget, bits, query mode, decode budget, task) becomes an ordered categorical, and ``series`` names what a figure's
line stands for: the policy with its bits (where rows were stored in several) and its decode budget. Tables,
figures, the HTML page and the exports read that order from the columns (``sort_values``, ``.cat.categories``)
rather than sorting again.

The orders: policies as the registry lists them (``policies/registry.py``), then by label; token budgets ascending,
then fractions kept, then kvpress's compression ratios (the kept share ascending); bits widest first; the paper's
query mode first; no cut while decoding first, then the decode budgets ascending; LongBench's tasks in its tables'
order, then the others by name.
"""

from __future__ import annotations

import math

import pandas as pd

from pkvbench.cell.schema import AGNOSTIC, NO_TURNS, QUERY_MODES, TABLE_KEY, TURN_COMPRESSIONS
from pkvbench.policies.registry import policy_order

# LongBench v1's 21 tasks in the order of its own tables (the paper's 16 English tasks keep their Table 1 order).
LONGBENCH_ORDER = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
FULL = "full"
AGNOSTIC_SUFFIX = " (agnostic)"
SERIES = "series"  # the column: what a figure's line stands for (policy, bits, decode budget)


# --- the orders ------------------------------------------------------------------------------------------------------


def budget_sort_key(label: str) -> tuple[int, float]:
    """Token budgets first (ascending), then fractions kept (ascending), then kvpress compression ratios (the
    fraction removed; largest first, so that the kept share ascends as in the others)."""
    try:
        if str(label).startswith("cr"):
            return (2, -float(str(label)[2:]))
        value = float(label)
    except ValueError:  # not a budget: a row over all budgets (the gate's pooled rows)
        return (3, 0.0)
    return (0, value) if value >= 1 else (1, value)


def policy_sort_key(label: str) -> tuple[int, str]:
    order = policy_order()
    name = label.split(":")[0].split(" ")[0]  # "snapkv (agnostic)" sorts with snapkv
    return (order.index(name) if name in order else len(order), label)


def query_mode_sort_key(mode: str) -> int:
    """The paper's setting (question inside the compressed prompt) first."""
    return QUERY_MODES.index(mode) if mode in QUERY_MODES else len(QUERY_MODES)


def decode_budget_sort_key(label: str) -> tuple[int, int]:
    """No cut while decoding first, then the decode budgets ascending."""
    return (0, 0) if not str(label).isdigit() else (1, int(label))


def turn_compression_sort_key(label: str) -> int:
    """No conversation first, then compressed once, then every turn."""
    order = (NO_TURNS, *TURN_COMPRESSIONS)
    return order.index(label) if label in order else len(order)


def bits_sort_key(label: str) -> tuple[float, str]:
    """Widest first: 32, 16, 8, 4, 2 (``native`` first of all: the model's own cache, width unknown)."""
    head = str(label).split(" ")[0]
    return (-float(head) if head.replace(".", "").isdigit() else -math.inf, str(label))


def _task_key(task: str) -> tuple[int, int, str]:
    base = task[:-2] if task.endswith("_e") else task
    return (0, LONGBENCH_ORDER.index(base), task) if base in LONGBENCH_ORDER else (1, 0, task)


def task_order(tasks) -> list[str]:
    return sorted(dict.fromkeys(tasks), key=_task_key)


SORT_KEYS = {
    "policy": policy_sort_key,
    "budget": budget_sort_key,
    "query_mode": query_mode_sort_key,
    "kv_bits": bits_sort_key,
    "decode_budget": decode_budget_sort_key,
    "turn_compression": turn_compression_sort_key,
    "task": _task_key,
}

# The grid's axes as a table lists them after the model: the key's fields that have an order, the bits the cache was
# stored in right after the policy. The optional ones show only where some row is not the paper's setting
# (``report.row_axes``); the others are the paper's cell, model × policy × budget (``KEY``).
ROW_AXES = ("policy", "kv_bits", *(name for name in TABLE_KEY if name in SORT_KEYS and name not in ("task", "policy")))
OPTIONAL_AXES = ("kv_bits", "query_mode", "decode_budget", "turn_compression")
KEY = ["model", *(axis for axis in ROW_AXES if axis not in OPTIONAL_AXES)]
# A line of a figure (``SERIES`` folds the bits, the decode budget and the turn compression into the policy) at a
# budget and query mode.
LINE_KEY = ["model", *(axis for axis in ROW_AXES if axis not in ("kv_bits", "decode_budget", "turn_compression"))]


def sort_rows(frame: pd.DataFrame, columns) -> pd.DataFrame:
    """``frame`` sorted by ``columns``, each axis in its order (others, the model and the task included, as
    written: the gate's and the tables' files keep their order)."""
    keys = {name: key for name, key in SORT_KEYS.items() if name != "task"}
    order = sorted(
        range(len(frame)),
        key=lambda i: tuple(keys.get(c, lambda v: v)(frame.iloc[i][c]) for c in columns),
    )
    return frame.iloc[order].reset_index(drop=True)


def is_full(policy: str) -> bool:
    """The full cache under any label the figures give it (``full``, ``full · 16 bits``, ``full (agnostic)``)."""
    return str(policy).split(":")[0].split(" ")[0] == FULL


# --- the folds: a policy with the settings that make it another line ------------------------------------------------


def with_decode_in_policy(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each policy that cut its cache while decoding named with its decode budget (``snapkv (decode
    64)``), for figures whose lines are policies over the prefill budget; the full cache, never cut, keeps its name."""
    if "decode_budget" not in frame.columns:
        return frame
    labels = [
        p if d == "none" or is_full(p) else f"{p} (decode {d})" for p, d in zip(frame["policy"], frame["decode_budget"])
    ]
    return frame.assign(policy=labels)


def with_turns_in_policy(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each policy whose conversation was cut back to its budget after every turn named so
    (``snapkv (every-turn)``): compressed once, the conversation's cache is the policy's at the prefill; the full
    cache, never cut, keeps its name."""
    if "turn_compression" not in frame.columns:
        return frame
    labels = [
        f"{p} ({t})" if t not in (NO_TURNS, TURN_COMPRESSIONS[0]) and not is_full(p) else p
        for p, t in zip(frame["policy"], frame["turn_compression"])
    ]
    return frame.assign(policy=labels)


def with_bits_in_policy(frame: pd.DataFrame) -> pd.DataFrame:
    """Where rows' caches were stored in several formats, each policy × bits as a policy of its own (``snapkv ·
    4 bits``): for the figures and views that key on the policy alone."""
    if "kv_bits" not in frame.columns or frame["kv_bits"].nunique() < 2:
        return frame
    return frame.assign(policy=[f"{p} · {b} bits" for p, b in zip(frame["policy"], frame["kv_bits"])])


# --- once, when rows are loaded --------------------------------------------------------------------------------------


def _ordered(values: pd.Series, key) -> pd.Categorical:
    return pd.Categorical(values, categories=sorted(values.dropna().unique(), key=key), ordered=True)


def order_axes(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with each axis column an ordered categorical (its categories the values present, in the axis's
    order) and ``series``: the policy with its bits (where several), decode budget and turn compression, ordered by
    policy, bits, decode budget and turn compression."""
    rows = rows.copy()
    folded = with_turns_in_policy(with_decode_in_policy(with_bits_in_policy(rows)))["policy"]
    axes = [c for c in ("policy", "kv_bits", "decode_budget", "turn_compression") if c in rows.columns]
    rank = {}
    for label, *key in zip(folded, *(rows[c] for c in axes)):
        rank.setdefault(label, tuple(SORT_KEYS[axis](value) for axis, value in zip(axes, key)))
    rows[SERIES] = pd.Categorical(folded, categories=sorted(rank, key=lambda label: rank[label]), ordered=True)
    for column, key in SORT_KEYS.items():
        if column in rows.columns:
            rows[column] = _ordered(rows[column].astype(str), key)
    return rows


def with_query_modes(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows whose question came after compression drawn as a line of their own, ``snapkv (agnostic)`` (``series``),
    each right after its query-aware line: each figure then shows both query modes side by side."""
    if "query_mode" not in rows.columns or not (rows["query_mode"] == AGNOSTIC).any():
        return rows
    agnostic = rows["query_mode"] == AGNOSTIC
    labels = [s + AGNOSTIC_SUFFIX if a else s for s, a in zip(rows[SERIES].astype(str), agnostic)]
    order = [c + suffix for c in rows[SERIES].cat.categories for suffix in ("", AGNOSTIC_SUFFIX)]
    return rows.assign(
        **{SERIES: pd.Categorical(labels, categories=[c for c in order if c in set(labels)], ordered=True)}
    )


def present(values: pd.Series) -> list:
    """An axis column's values that occur in ``values``, in the axis's order."""
    return list(values.cat.remove_unused_categories().cat.categories)
