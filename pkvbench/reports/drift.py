"""Output-length drift and memory while decoding: what compression does to an answer's length and to the cache it
holds (``pkvbench report``'s second table). Reads result rows only.

Per model × task × policy × budget (× query mode × decode budget): the answers' mean length in tokens, their length
over the full cache's answer to the same sample (a paired ratio: above 1, compression made answers longer, as
Rethink-KV found), the share that ran into the token limit, and the largest cache held while decoding (entries summed
over layers and heads, and stored bytes), each mean with its 95% bootstrap interval over samples.
"""

from __future__ import annotations

import math

import pandas as pd

from pkvbench.cell.schema import SAMPLE_KEY
from pkvbench.reports.axes import full_rows
from pkvbench.reports.report import interval_columns, row_axes
from pkvbench.reports.stats import mean_interval


def length_table(rows: pd.DataFrame) -> pd.DataFrame | None:
    """The table, or None when the rows do not record answer lengths and peak caches (written before they did)."""
    if not {"new_tokens", "peak_kv_entries"} <= set(rows.columns):
        return None
    rows = rows[rows["peak_kv_entries"].notna()].copy()
    if rows.empty:
        return None
    key = [*row_axes(rows), "task"]
    same = list(SAMPLE_KEY)
    full = rows[full_rows(rows["policy"])].drop_duplicates(same).set_index(same)["new_tokens"]
    rows["length_ratio"] = [
        tokens / full.get(tuple(r), math.nan) if full.get(tuple(r), 0) else math.nan
        for tokens, r in zip(rows["new_tokens"], rows[same].itertuples(index=False))
    ]
    rows["hit_limit"] = rows["hit_limit"].astype(float) if "hit_limit" in rows else math.nan
    out = []
    for index, cell in rows.groupby(key, sort=False):
        record = dict(zip(key, index))
        record["n"] = len(cell)
        for column, scale in (("new_tokens", 1), ("length_ratio", 1), ("hit_limit", 100), ("peak_kv_entries", 1)):
            values = pd.to_numeric(cell[column], errors="coerce").dropna() * scale
            low, high = mean_interval(values) if len(values) else (math.nan, math.nan)
            name = "hit_limit %" if column == "hit_limit" else column
            record[name] = values.mean() if len(values) else math.nan
            record[interval_columns(name)[0]], record[interval_columns(name)[1]] = low, high
        record["peak_kv_MiB"] = pd.to_numeric(cell["peak_kv_bytes"], errors="coerce").mean() / 2**20
        out.append(record)
    table = pd.DataFrame(out)
    numeric = [c for c in table.columns if c not in (*key, "n")]
    table[numeric] = table[numeric].astype(float).round(2)
    order = ["task", *row_axes(rows)]  # the task as written first, then the axes' order (load_runs)
    table = table.astype({c: rows[c].dtype for c in order if c not in ("task", "model")})
    by_name = lambda column: column.astype(str) if column.name == "task" else column  # noqa: E731
    return table.sort_values(order, key=by_name, kind="stable").reset_index(drop=True)
