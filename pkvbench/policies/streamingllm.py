"""StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window.

Rule: keep the first ``sink`` positions and the last ``k - sink`` positions. Scores play no part.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Policy, keep_all


@dataclass(frozen=True)
class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "first `sink` positions + last k-sink positions"
    sink: int = 4

    @property
    def min_budget(self) -> int:
        return max(self.sink, 1)

    def keep(self, stats: LayerStats, k: int) -> torch.Tensor:
        length = stats.context_len
        if k >= length:
            return keep_all(stats)
        positions = torch.cat([torch.arange(self.sink), torch.arange(length - (k - self.sink), length)])
        return positions.expand(stats.num_kv_heads, k)
