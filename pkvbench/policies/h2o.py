"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

Rule, per layer: score each position by the sum over all T prompt queries of the causal softmax attention it
receives (``scores=all``); with ``normalize=true`` divide that sum by the number of queries that can see the
position (T - p), since early positions otherwise collect attention from more queries; fold query heads onto their
KV head; keep the last ``window`` positions plus the top ``k - window`` of the others.

``scores=window`` is the PyramidKV paper's own H2O (the one behind its Table 1): the sum over the last ``window``
queries only, with no pooling. It is SnapKV without the pool.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import LayerStats, Needs, ScoringPolicy, group_by_kv_head


@dataclass(frozen=True)
class H2O(ScoringPolicy):
    name = "h2o"
    summary = "accumulated attention of all prompt queries; top k-window + window"
    in_default_grid = True
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"scores": ("all", "window"), "gqa": ("mean", "max")}
    positive = ("window",)
    window: int = 8
    scores: str = "all"
    normalize: bool = False
    gqa: str = "mean"

    @property
    def needs(self) -> Needs:
        if self.scores == "window":
            return Needs(windows=frozenset({self.window}))
        return Needs(accumulated=True)

    @property
    def keeps_recent(self) -> int:
        return self.window

    def position_scores(self, stats: LayerStats) -> torch.Tensor:
        """``[num_query_heads, T]`` scores before grouping."""
        length = stats.context_len
        if self.scores == "window":
            totals = stats.window(self.window)
            # Position p is seen by the window queries at positions >= p.
            seen_by = (length - torch.arange(length)).clamp(max=self.window)
        else:
            totals = stats.accumulated_attention()
            seen_by = length - torch.arange(length)
        if self.normalize:
            totals = totals / seen_by.to(totals)
        return totals

    def score(self, stats: LayerStats) -> torch.Tensor:
        return group_by_kv_head(self.position_scores(stats), stats.num_kv_heads, self.gqa)
