"""The grid's axes, ordered and labelled once: when ``report.load_runs`` reads the rows, each axis column (policy,
budget, bits, query mode, decode budget, task) becomes an ordered categorical, and ``series`` names what a figure's
line stands for: the policy with its bits (where rows were stored in several) and its decode budget. Tables,
figures, the HTML page and the exports read that order from the columns (``sort_values``, ``.cat.categories``)
rather than sorting again.

The orders: policies as the registry lists them (``policies/registry.py``), then by label; token budgets ascending,
then fractions kept, then kvpress's compression ratios (the kept share ascending); bits widest first; the paper's
query mode first; no cut while decoding first, then the decode budgets ascending; LongBench's tasks in its tables'
order, then the others by name.

The labels: a cell is named once, by ``cell_label`` (``snapkv · 4 bits · decode 64``, ``@ 128`` with its budget): the
policy, then each axis of ``LABELLED`` in its words, leaving out the values that are the paper's setting. A budget's
kind (entries, a fraction of the prompt, a compression ratio, memory) is ``budget_kind``'s, read from
``cell.budgets.Budget``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from pkvbench.cell.budgets import Budget
from pkvbench.cell.kv_formats import label_width
from pkvbench.cell.schema import AGNOSTIC, NO_TURNS, ONCE, QUERY_MODES, TABLE_KEY, TURN_COMPRESSIONS
from pkvbench.errors import PkvError
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
NATIVE = "native"  # the bits of a row written before storage formats that does not say its dtype (results.bits_label)

# A budget's kind: each is a number line of its own (a figure's panels, the budget axis's order).
ENTRIES = "entries per head"
FRACTION = "fraction of the prompt"
REMOVED = "compression ratio"  # kvpress's: the fraction removed
EVERY_ENTRY = "every entry"  # ``all``: the full cache's one point per storage format in a memory grid
MEMORY_SHARE = "memory share"  # of the full cache's bytes at 16 bits
MEMORY_BYTES = "memory bytes"
MEMORY_KINDS = (MEMORY_SHARE, MEMORY_BYTES)
NUMBER_LINE = (ENTRIES, FRACTION)  # the kinds score-vs-budget curves draw, each on its own log axis


# --- a budget's kind -------------------------------------------------------------------------------------------------


@functools.cache
def budget_point(label: str) -> tuple[str, float]:
    """A budget label's kind and its place on that kind's number line: entries per KV head, the fraction of the
    prompt kept, kvpress's compression ratio (the fraction removed), the memory share or bytes, ``all`` at 1. Not a
    budget (the gate's pooled ``*``): ``PkvError``."""
    budget = Budget.parse(label)
    if budget.keeps_all:
        return EVERY_ENTRY, 1.0
    if budget.memory:
        return (MEMORY_SHARE if isinstance(budget.value, float) else MEMORY_BYTES), budget.value
    if budget.removed:
        return REMOVED, budget.value
    return (FRACTION if budget.is_fraction else ENTRIES), float(budget.value)


def budget_kind(label: str) -> str:
    """A budget label's kind: ``ENTRIES``, ``FRACTION``, ``REMOVED``, ``EVERY_ENTRY`` or one of ``MEMORY_KINDS``."""
    return budget_point(str(label))[0]


def of_kind(budgets: pd.Series, *kinds: str) -> pd.Series:
    """Which ``budgets`` are of one of ``kinds``: a plain boolean Series (see ``full_rows``)."""
    return pd.Series([budget_kind(b) in kinds for b in budgets], index=budgets.index, dtype=bool)


# --- the orders ------------------------------------------------------------------------------------------------------


def budget_sort_key(label: str) -> tuple[int, float]:
    """Token budgets first (ascending), then fractions kept (ascending), then kvpress compression ratios (the
    fraction removed; largest first, so that the kept share ascends as in the others); the others as they come."""
    try:
        kind, value = budget_point(str(label))
    except PkvError:  # not a budget: a row over all budgets (the gate's pooled rows)
        return (3, 0.0)
    if kind == REMOVED:
        return (2, -value)
    return (NUMBER_LINE.index(kind), value) if kind in NUMBER_LINE else (3, 0.0)


def policy_name(label: str) -> str:
    """The registry's name in a policy's label: ``snapkv`` of ``snapkv:window=32 · 4 bits (agnostic)``."""
    return str(label).split(":")[0].split(" ")[0]


def policy_sort_key(label: str) -> tuple[int, str]:
    order = policy_order()
    name = policy_name(label)  # "snapkv (agnostic)" sorts with snapkv
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
    """Widest first: 32, 16, 8 and fp8, 4 and tq4, tq3, 2 (``native`` first of all: the model's own cache, width
    unknown)."""
    width = label_width(label)
    return (-width if width is not None else -math.inf, str(label))


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
    return policy_name(policy) == FULL


def full_rows(policies: pd.Series) -> pd.Series:
    """Which rows are the full cache's, as a plain boolean Series: ``policies.map(is_full)`` over the ordered
    categorical ``load_runs`` makes is itself a categorical under pandas 3 wherever the map is one-to-one (full and
    one other policy), and ``~`` or ``&`` on it fail."""
    return pd.Series([is_full(p) for p in policies], index=policies.index, dtype=bool)


# --- the labels: a cell named once -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Labelled:
    """How a label names one axis's value after the policy."""

    words: Callable[[str], str]
    unsaid: tuple[str, ...] = ()  # values labels leave out: the paper's setting
    several: bool = False  # a figure's line names it only where the rows hold several values (else it is the run's)
    full: bool = True  # the full cache's line names it too (False: the value never changes what the full cache does)


def storage_words(value: str) -> str:
    """``4 bits``, ``4 g64 r32 bits``, ``native bits``: a width; a storage format's own name (``fp8``) stands alone."""
    return f"{value} bits" if value[:1].isdigit() or value == NATIVE else value


# The axes a label names after the policy, in this order: an axis added to the grid is one entry here (and its order
# one in ``SORT_KEYS``). ``kv_bits`` holds a row's storage as tables show it; ``kv_stored``, the key's, is "" for the
# model's own cache (``key_label``).
LABELLED = {
    "kv_bits": Labelled(storage_words, unsaid=("",), several=True),
    "decode_budget": Labelled("decode {}".format, unsaid=("none",), full=False),
    # a conversation's cache cut back to its budget after every turn (compressed once: the policy's at the prefill)
    "turn_compression": Labelled("{}".format, unsaid=(NO_TURNS, ONCE), full=False),
}


def _said(entry: Labelled, value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and str(value) not in entry.unsaid


def cell_label(cell: Mapping[str, Any], at_budget: bool = False) -> str:
    """``snapkv · 4 bits · decode 64``: a cell's policy with each ``LABELLED`` axis ``cell`` has, in its words (a
    value that is the paper's setting left out); with ``at_budget``, `` @ 128``: the cell's budget."""
    parts = [str(cell["policy"])]
    parts += [entry.words(str(cell[axis])) for axis, entry in LABELLED.items() if _said(entry, cell.get(axis))]
    label = " · ".join(parts)
    return f"{label} @ {cell['budget']}" if at_budget else label


def key_label(cell: Mapping[str, Any], at_budget: bool = False) -> str:
    """``cell_label`` of a cell as the store keys it (``schema.CELL_KEY``: the gate's cells, the exports' folders):
    its storage is ``kv_stored``, empty for the model's own cache, which goes unsaid."""
    return cell_label({**cell, "kv_bits": cell.get("kv_stored")}, at_budget)


def series_labels(frame: pd.DataFrame) -> list[str]:
    """What each row's line in a figure stands for: its ``cell_label`` over the ``LABELLED`` axes the rows have,
    those said only where several (the bits) where the rows hold several values, and the full cache's line without
    those that never change it (``snapkv · 4 bits · decode 64``, ``full · 4 bits``)."""
    axes = [a for a, e in LABELLED.items() if a in frame.columns and (not e.several or frame[a].nunique() > 1)]
    return [
        cell_label(
            {"policy": policy, **{a: v for a, v in zip(axes, values) if LABELLED[a].full or not is_full(policy)}}
        )
        for policy, *values in zip(frame["policy"], *(frame[a] for a in axes))
    ]


# --- once, when rows are loaded --------------------------------------------------------------------------------------


def _ordered(values: pd.Series, key) -> pd.Categorical:
    return pd.Categorical(values, categories=sorted(values.dropna().unique(), key=key), ordered=True)


def order_axes(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with each axis column an ordered categorical (its categories the values present, in the axis's
    order) and ``series``: the policy with its bits (where several) and decode budget, ordered by policy, bits and
    decode budget."""
    rows = rows.copy()
    folded = series_labels(rows)
    axes = ["policy", *(c for c in LABELLED if c in rows.columns)]
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
