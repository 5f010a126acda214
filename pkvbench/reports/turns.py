"""Accuracy turn by turn: a conversation's rows (``--query-mode multi-turn``) as one more axis.

``pkvbench report`` adds, for runs with conversations, a table per task of each cell (policy × budget × turn
compression, × the bits and the model where they vary) by turn: the mean score × 100 at each turn over the
conversations, with its 95% bootstrap interval, the curve of those means over the turns, and n conversations.
``pkvbench plot`` draws the curves (``figures/plots.py``: score over turns, a line per policy and budget).
"""

from __future__ import annotations

import pandas as pd

from pkvbench.reports.report import interval_columns, row_axes
from pkvbench.reports.stats import mean_interval

TURN = "turn"
CURVE = "curve"
_BLOCKS = "▁▂▃▄▅▆▇█"


def has_turns(rows: pd.DataFrame) -> bool:
    return TURN in rows.columns and bool(rows[TURN].notna().any())


def turn_label(turn: int) -> str:
    return f"{TURN} {int(turn)}"


def sparkline(values: list[float]) -> str:
    """The means over the turns as one line of blocks, 0 to 100 (a missing turn: a space)."""
    return "".join(
        " " if pd.isna(v) else _BLOCKS[min(len(_BLOCKS) - 1, max(0, int(v / 100 * len(_BLOCKS))))] for v in values
    )


def turn_table(rows: pd.DataFrame, intervals: bool = True) -> pd.DataFrame:
    """Rows task × the report's cell (model, policy, budget, turn compression, …); a column per turn (score × 100;
    with ``intervals`` its 95% interval columns), ``curve`` and ``n`` (conversations behind the first turn)."""
    rows = rows[rows[TURN].notna()].assign(**{TURN: lambda frame: frame[TURN].astype(int)})
    key = ["task", *(axis for axis in row_axes(rows) if axis != "query_mode")]
    turns = sorted(rows[TURN].unique())
    grouped = rows.groupby([*key, TURN], sort=True, observed=True)["score"]
    means = grouped.mean().mul(100).unstack(TURN).reindex(columns=turns)
    table = pd.DataFrame(index=means.index)
    for turn in turns:
        label = turn_label(turn)
        table[label] = means[turn]
        if intervals:
            low, high = interval_columns(label)
            bounds = {index[:-1]: mean_interval(values) for index, values in grouped if index[-1] == turn}
            table[low] = [bounds.get(index, (float("nan"),) * 2)[0] * 100 for index in table.index]
            table[high] = [bounds.get(index, (float("nan"),) * 2)[1] * 100 for index in table.index]
    table[CURVE] = [sparkline(list(values)) for values in means.itertuples(index=False)]
    table["n"] = rows[rows[TURN] == turns[0]].groupby(key, sort=True, observed=True).size().reindex(table.index)
    table = table.reset_index()
    numeric = [c for turn in turns for c in (turn_label(turn), *interval_columns(turn_label(turn))) if c in table]
    table[numeric] = table[numeric].astype(float).round(2)
    return table
