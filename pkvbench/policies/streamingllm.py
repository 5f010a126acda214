"""StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window.

Rule: keep the first ``sink`` positions and the last ``k - sink`` positions. As scores: the sinks score +inf, every
other position its index (later is better). Attention plays no part.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class StreamingLLM(ScoringPolicy):
    name = "streamingllm"
    summary = "first `sink` positions + last k-sink positions"
    in_default_grid = True
    sink: int = 4

    @property
    def min_budget(self) -> int:
        return max(self.sink, 1)

    def score(self, stats: LayerStats) -> torch.Tensor:
        recency = torch.arange(stats.context_len, dtype=torch.float32)
        recency[: self.sink] = float("inf")
        return recency.expand(stats.num_kv_heads, -1)
