"""SnapKV (Li et al., 2024): the last prompt queries vote for the entries worth keeping.

Rule, per layer: for each position before the observation window (``p < T - window``), sum the causal softmax
attention it receives from the last ``window`` queries; smooth those sums along the sequence with a 1-D pool
(``kernel``, stride 1, same padding; max by default, over the pre-window positions only, as the reference code does);
fold query heads onto their KV head (mean, or max); keep the top ``k - window`` plus the whole window.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pkvbench.policies.base import LayerStats, Policy, group_by_kv_head, keep_all, keep_window_plus_top


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth ``[heads, n]`` scores along the last axis; ``kernel`` odd keeps the length."""
    if pooling == "none" or kernel <= 1:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(0)


@dataclass(frozen=True)
class SnapKV(Policy):
    name = "snapkv"
    summary = "last `window` queries' attention, max-pooled (kernel 7); top k-window + window"
    choices = {"pooling": ("max", "avg", "none"), "gqa": ("mean", "max")}
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be odd so that pooling keeps every position")

    @property
    def windows_needed(self) -> set[int]:
        return {self.window}

    @property
    def min_budget(self) -> int:
        return max(self.window, 1)

    def keep(self, stats: LayerStats, k: int) -> torch.Tensor:
        length = stats.context_len
        if k >= length:
            return keep_all(stats)
        prefix = stats.window_scores[self.window][:, : length - self.window]
        pooled = pool_scores(prefix, self.kernel, self.pooling)
        grouped = group_by_kv_head(pooled, stats.num_kv_heads, self.gqa)
        return keep_window_plus_top(grouped, k, self.window, length)
