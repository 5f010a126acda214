"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

Rule, per layer: score each position by the sum over all T prompt queries of the causal softmax attention it
receives (``scores=all``); with ``normalize=true`` divide that sum by the number of queries that can see the
position (T - p), since early positions otherwise collect attention from more queries; fold query heads onto their
KV head (``gqa``, as SnapKV's); keep the last ``window`` positions plus the top ``k - window`` of the others.
Nothing is pooled.

The variants the PyramidKV paper's code (Zefan-Cai/KVCache-Factory, ``H2OKVCluster``) has run, by what they compute:

- ``scores=window``: the last ``window`` queries only — the code of June–September 2024 (``4c9bbc3``), behind the
  paper's Table 1. It is SnapKV without the pool.
- ``scores=all-bidirectional``: all T queries, but only the last ``window`` × ``window`` block causally masked, so
  every earlier query also attends to the keys after it — the code of 2024-10-13 (``98e8228``) to 2026-06-22, behind
  most published KVCache-Factory H2O numbers.
- ``scores=all``: all T queries, causal — the code since 2026-06-22 (``9f9aa2e``), and H2O's own rule.

While the answer is written (``--decode-budget``) the sums are carried on: each new token's query adds its attention
to the entries in the cache then (H2O's own accumulation during generation), and ``normalize`` divides by the queries
that could see an entry since its position. ``scores=all-bidirectional`` has no such rule (its earlier queries see
keys that come after them).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import GQA_MODES, LayerStats, Needs, WindowedPolicy, group_by_kv_head


@dataclass(frozen=True)
class H2O(WindowedPolicy):
    name = "h2o"
    summary = "accumulated attention of all prompt queries; top k-window + window"
    in_default_grid = True
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"scores": ("all", "all-bidirectional", "window"), "gqa": GQA_MODES}
    reference_options: ClassVar[dict[str, object]] = {"gqa": "query", "ties": "topk"}
    scores: str = "all"
    normalize: bool = False
    gqa: str = "mean"

    @property
    def needs(self) -> Needs:
        if self.scores == "window":
            return Needs(windows=frozenset({self.window}))
        if self.scores == "all-bidirectional":
            return Needs(bidirectional=frozenset({self.window}))
        return Needs(accumulated=True)

    def decoding_refusal(self) -> str | None:
        if self.scores == "all-bidirectional":
            return f"{self.label}: scores=all-bidirectional has no decode-time rule (its queries see later keys)"
        return super().decoding_refusal()

    def position_scores(self, stats: LayerStats) -> torch.Tensor:
        """``[num_query_heads, T]`` scores before grouping."""
        length = stats.context_len
        if self.scores == "window":
            totals = stats.window(self.window)
            # Position p is seen by the window queries at positions >= p.
            seen_by = (length - torch.arange(length)).clamp(max=self.window)
        elif self.scores == "all-bidirectional":
            totals = stats.bidirectional_attention(self.window)
            seen_by = torch.full((length,), float(length))
        else:
            totals = stats.accumulated_attention()
            # every query from the entry's own position on saw it (while decoding too: a dropped entry never returns)
            seen_by = stats.next_position - stats.entry_positions()
            seen_by = seen_by.repeat_interleave(totals.shape[0] // seen_by.shape[0], dim=0)
        if self.normalize:
            totals = totals / seen_by.to(totals)
        return totals

    def score(self, stats: LayerStats) -> torch.Tensor:
        return group_by_kv_head(self.position_scores(stats), stats.num_kv_heads, self.gqa)
