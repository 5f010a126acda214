"""``summary.csv``: each cell's score with its interval, from a run's rows."""

from __future__ import annotations

import pandas as pd

from pkvbench.cell.budgets import budget_label
from pkvbench.cell.schema import CELL_KEY, DEFAULT_QUERY_MODE, NO_TURNS
from pkvbench.reports.stats import cell_scores
from pkvbench.store.results import Row, bits_label, decode_budget_label, stored_as


def summarize(rows: list[Row]) -> pd.DataFrame:
    """``task, policy, budget, [query_mode,] [decode_budget,] [turn_compression,] n, score, ci_low, ci_high``: score
    the mean × 100, two decimals (LongBench's convention), with its 95% bootstrap interval over samples
    (``stats.mean_interval``); ``query_mode`` when the rows record it, ``decode_budget`` when any row has one,
    ``turn_compression`` when any row is a conversation's turn (the turns pooled)."""
    stored = any(stored_as(row) for row in rows)
    # rows read back from disk say "none" (or NaN) where no budget was set: only a real one is an axis
    decoding = any(decode_budget_label(row.get("decode_budget")) != "none" for row in rows)
    turns = any(row.get("turn_compression") for row in rows)
    present = {
        "query_mode": any("query_mode" in row for row in rows),
        "decode_budget": decoding,
        "turn_compression": turns,
    }
    # the cell's key where the rows have it (one run: one model), its storage as the bits beside the policy
    key = [name for name in CELL_KEY if name not in ("model", "kv_stored") and present.get(name, True)]
    at = key.index("policy") + 1
    axes = [*key[:at], *(["kv_bits"] if stored else []), *key[at:]]
    columns = [*axes, "n", "score", "ci_low", "ci_high"]
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows)
    frame["budget"] = [budget_label(row["budget"]) for row in rows]
    if stored:  # the bits each value was stored in are an axis of the grid (docs/memory.md)
        frame["kv_bits"] = [bits_label(row) for row in rows]
    if "query_mode" in axes:
        frame["query_mode"] = frame["query_mode"].fillna(DEFAULT_QUERY_MODE)
    if decoding:
        frame["decode_budget"] = [decode_budget_label(row.get("decode_budget")) for row in rows]
    if turns:  # a conversation's rows pool its turns; the other rows are no conversation's
        frame["turn_compression"] = [row.get("turn_compression") or NO_TURNS for row in rows]
    frame["score"] = pd.to_numeric(frame["score"], errors="coerce")
    return cell_scores(frame, axes)
