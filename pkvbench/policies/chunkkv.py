"""ChunkKV (Liu et al., 2025, arXiv 2502.00299): keep whole chunks of consecutive tokens, not single tokens.

A wrapper over any scoring policy (``chunkkv(snapkv)``): the prompt is cut into chunks of ``chunk_length`` tokens
from position 0 (the last one may be shorter); a chunk's score is the mean over its positions of the inner scores
summed over KV heads (what the inner policy always keeps, e.g. SnapKV's window, counts as +inf, so its chunks win;
``pinned=max+1``: as the highest other score + 1, kvpress's padding, so a chunk only partly in the window competes on
its mean); the best chunks are kept whole, the same positions for every head. This is kvpress's ``ChunkKVPress``
(chunk_length 20; the paper prefers 10). How many chunks:

- ``count=fill`` (pkvbench's default): chunks are taken in score order while they fit in k, so a layer keeps
  between k − chunk_length + 1 and k entries per head (never more than the budget; ``kv_kept`` records it).
- ``count=share`` (kvpress's, in the ``kvpress`` preset): the budget's share of the chunks, max(1, int(n·k/T)) of
  the n chunks, best first (``torch.topk``'s order), whatever entries they hold — up to chunk_length − 1 more or
  fewer than k. kvpress computes int(n·(1 − r)) from its compression ratio r, of which k = int(T·(1 − r)) keeps
  only the integer part: the two counts differ only where a multiple of T/n falls between k and T·(1 − r), less
  than one entry apart.

Under ``fill`` kvpress's set is a subset of pkvbench's in every head: the same ranking, fewer chunks
(``docs/kvpress-crosscheck.md``).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import LayerStats, keep_all
from pkvbench.policies.wrapper import Wrapper, full_scores


@dataclass(frozen=True)
class ChunkKV(Wrapper):
    name = "chunkkv"
    summary = "whole chunks of chunk_length tokens, ranked by the inner policy's mean score summed over heads"
    exact_count: ClassVar[bool] = False  # whole chunks: up to chunk_length - 1 fewer than k
    positive = ("chunk_length",)
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"count": ("fill", "share"), "pinned": ("inf", "max+1")}
    kvpress_options: ClassVar[dict[str, object]] = {"count": "share", "pinned": "max+1"}
    chunk_length: int = 20
    count: str = "fill"
    pinned: str = "inf"  # the score of what the inner policy always keeps

    @property
    def min_budget(self) -> int:
        return max(self.inner.min_budget, self.chunk_length)

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        length, heads = stats.context_len, stats.num_kv_heads
        if k >= length:
            return keep_all(length, heads)
        summed = full_scores(self.inner, stats, self.pinned).sum(dim=0)
        starts = torch.arange(0, length, self.chunk_length)
        sizes = (length - starts).clamp(max=self.chunk_length)
        means = torch.stack([summed[s : s + n].mean() for s, n in zip(starts.tolist(), sizes.tolist())])
        if self.count == "share":
            kept = torch.topk(means, max(1, len(starts) * k // length)).indices.tolist()
        else:
            kept = self._fill(means, sizes, k)
        if not kept:  # a layer budget below one chunk (a pyramid's top layers): the best chunk's best k positions
            best_chunk = int(torch.sort(means, descending=True, stable=True).indices[0])
            start = int(starts[best_chunk])
            inside = summed[start : start + int(sizes[best_chunk])]
            best = torch.sort(inside, descending=True, stable=True).indices[:k] + start
            return best.sort().values.expand(heads, -1)
        positions = torch.cat([torch.arange(int(starts[c]), int(starts[c] + sizes[c])) for c in sorted(kept)])
        return positions.expand(heads, -1)

    @staticmethod
    def _fill(means: torch.Tensor, sizes: torch.Tensor, k: int) -> list[int]:
        """Chunks in score order (ties to the earlier) while they fit in ``k`` entries."""
        kept, room = [], k
        for chunk in torch.sort(means, descending=True, stable=True).indices.tolist():
            if sizes[chunk] <= room:
                kept.append(chunk)
                room -= int(sizes[chunk])
        return kept
