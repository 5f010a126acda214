"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

Rule, per layer: score each position by the sum over all T prompt queries of the causal softmax attention it
receives (``scores=all``); with ``normalize=true`` divide that sum by the number of queries that can see the
position (T - p), since early positions otherwise collect attention from more queries; fold query heads onto their
KV head; keep the last ``window`` positions plus the top ``k - window`` of the others.

``scores=window`` is the PyramidKV paper's own H2O (the one behind its Table 1): the sum over the last ``window``
queries only, with no pooling. It is SnapKV without the pool.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Policy, group_by_kv_head, keep_all, keep_window_plus_top


@dataclass(frozen=True)
class H2O(Policy):
    name = "h2o"
    summary = "accumulated attention of all prompt queries; top k-window + window"
    choices = {"scores": ("all", "window"), "gqa": ("mean", "max")}
    window: int = 8
    scores: str = "all"
    normalize: bool = False
    gqa: str = "mean"

    @property
    def windows_needed(self) -> set[int]:
        return {self.window} if self.scores == "window" else set()

    @property
    def needs_accumulated(self) -> bool:
        return self.scores == "all"

    @property
    def min_budget(self) -> int:
        return max(self.window, 1)

    def position_scores(self, stats: LayerStats) -> torch.Tensor:
        """``[num_query_heads, T]`` scores before grouping."""
        length = stats.context_len
        if self.scores == "window":
            totals = stats.window_scores[self.window]
            # Position p is seen by the window queries at positions >= p.
            seen_by = (length - torch.arange(length)).clamp(max=self.window)
        else:
            totals = stats.accumulated
            seen_by = length - torch.arange(length)
        if self.normalize:
            totals = totals / seen_by.to(totals)
        return totals

    def keep(self, stats: LayerStats, k: int) -> torch.Tensor:
        length = stats.context_len
        if k >= length:
            return keep_all(stats)
        grouped = group_by_kv_head(self.position_scores(stats), stats.num_kv_heads, self.gqa)
        return keep_window_plus_top(grouped[:, : length - self.window], k, self.window, length)
