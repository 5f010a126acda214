"""StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window.

Rule: keep the first ``sink`` positions and the last ``k - sink`` positions. With ``recent=r`` the split is the
other way round: the last r positions and the first ``k - r`` — how the PyramidKV paper's code keeps StreamingLLM
in its needle script (window 32: the first k-32 and the last 32); its LongBench script keeps 4 sinks and the last
k-4, pkvbench's default. As scores: the sinks score +inf, every other position its index (later is better).
Attention plays no part. ``gqa=query`` stores the same positions once per query head, as the reference's cache does.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class StreamingLLM(ScoringPolicy):
    name = "streamingllm"
    summary = "first `sink` positions + last k-sink positions (or last `recent` + first k-recent)"
    in_default_grid = True
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"gqa": ("kv", "query")}
    reference_options: ClassVar[dict[str, object]] = {"gqa": "query"}
    sink: int = 4
    recent: int = 0
    gqa: str = "kv"

    @property
    def min_budget(self) -> int:
        return max(self.recent or self.sink, 1)

    @property
    def keeps_recent(self) -> int:
        return self.recent

    def score(self, stats: LayerStats) -> torch.Tensor:
        scores = torch.arange(stats.context_len, dtype=torch.float32)
        if self.recent:
            scores = -scores  # beyond the recent window, the earliest positions are the ones kept
        else:
            scores[: self.sink] = float("inf")
        return scores.expand(self.cache_heads(stats), -1)
