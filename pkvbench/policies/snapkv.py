"""SnapKV (Li et al., 2024): the last prompt queries vote for the entries worth keeping.

Rule, per layer: for each position before the observation window (``p < T - window``), sum the causal softmax
attention it receives from the last ``window`` queries; smooth those sums along the sequence with a 1-D pool
(``kernel``, stride 1, same padding; max by default, over the pre-window positions only, as the reference code does);
fold query heads onto their KV head (mean, or max); keep the top ``k - window`` plus the whole window.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pkvbench.policies.base import LayerStats, Needs, ScoringPolicy, group_by_kv_head


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth ``[heads, n]`` scores along the last axis; ``kernel`` odd keeps the length."""
    if pooling == "none" or kernel <= 1:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(0)


@dataclass(frozen=True)
class SnapKV(ScoringPolicy):
    name = "snapkv"
    summary = "last `window` queries' attention, max-pooled (kernel 7); top k-window + window"
    in_default_grid = True
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"pooling": ("max", "avg", "none"), "gqa": ("mean", "max")}
    positive = ("window", "kernel")
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be odd so that pooling keeps every position")

    @property
    def needs(self) -> Needs:
        return Needs(windows=frozenset({self.window}))

    @property
    def keeps_recent(self) -> int:
        return self.window

    def score(self, stats: LayerStats) -> torch.Tensor:
        window = stats.window(self.window)
        prefix_len = max(stats.context_len - self.window, 0)
        pooled = pool_scores(window[:, :prefix_len], self.kernel, self.pooling)
        # The window's own positions are kept whatever they score; zeros stand in for them.
        scores = torch.cat([pooled, torch.zeros_like(window[:, prefix_len:])], dim=1)
        return group_by_kv_head(scores, stats.num_kv_heads, self.gqa)
