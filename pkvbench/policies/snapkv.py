"""SnapKV (Li et al., 2024): the last prompt queries vote for the entries worth keeping.

Rule, per layer: for each position before the observation window (``p < T - window``), sum the causal softmax
attention it receives from the last ``window`` queries; smooth those sums along the sequence with a 1-D pool
(``kernel``, stride 1, same padding; max by default, over the pre-window positions only, as the reference code does);
keep the top ``k - window`` plus the whole window.

Grouped-query attention (``gqa``): ``mean``/``max`` fold each group's pooled scores and keep one set per KV head
(pkvbench's default: the cache really shrinks); ``kv-mean-first`` averages the group's window sums *before* pooling
(the reference code's opt-in per-KV-head mode, ``--kv_cache_granularity kv_head``, KVCache-Factory ``ad51c4e``);
``query`` keeps one set per query head, as the reference code does by default (keys and values repeated to every
query head before compressing; ``pyramidkv/llama_model.py``), so the cache holds one set per query head.
Reference: Zefan-Cai/KVCache-Factory ``pyramidkv/pyramidkv_utils.py`` ``SnapKVCluster.update_kv`` (``4c9bbc3`` and
unchanged since): window logits over all T keys, causal mask on the window block, fp32 softmax, sum over the window
queries for the prefix positions, max-pool kernel 7, ``topk(k - window)``, then the window appended.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pkvbench.policies.base import GQA_MODES, LayerStats, Needs, WindowedPolicy, group_by_kv_head


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Smooth ``[heads, n]`` scores along the last axis; ``kernel`` odd keeps the length. Max-pooling pads with -inf
    and average-pooling counts the zero padding (PyTorch's defaults, as the reference code uses them)."""
    if pooling == "none" or kernel <= 1:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(0)


@dataclass(frozen=True)
class SnapKV(WindowedPolicy):
    name = "snapkv"
    summary = "last `window` queries' attention, max-pooled (kernel 7); top k-window + window"
    in_default_grid = True
    choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "pooling": ("max", "avg", "none"),
        "gqa": (*GQA_MODES, "kv-mean-first"),
    }
    positive = ("kernel",)
    odd = ("kernel",)
    reference_options: ClassVar[dict[str, object]] = {"gqa": "query", "ties": "topk"}
    # kvpress's SnapKVPress: window 64, average pooling of kernel 5 (its group mean after pooling is gqa=mean).
    kvpress_options: ClassVar[dict[str, object]] = {"window": 64, "kernel": 5, "pooling": "avg"}
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"

    @property
    def needs(self) -> Needs:
        return Needs(windows=frozenset({self.window}))

    @property
    def score_scale(self) -> float:
        """The window's attention summed (the reference code's), where kvpress's ``SnapKVPress`` averages it: no
        top-k notices the factor, CriticalKV's epsilon would."""
        return float(self.window)

    def score(self, stats: LayerStats) -> torch.Tensor:
        window = stats.window(self.window)
        prefix = window[:, : max(stats.context_len - self.window, 0)]
        if self.gqa == "kv-mean-first":
            return pool_scores(group_by_kv_head(prefix, stats.num_kv_heads, "mean"), self.kernel, self.pooling)
        return group_by_kv_head(pool_scores(prefix, self.kernel, self.pooling), stats.num_kv_heads, self.gqa)
