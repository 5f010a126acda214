"""Random: every position a uniform random score — the floor any informed policy must beat.

Rule, per layer and KV head: i.i.d. uniform scores from a generator seeded by ``seed`` and the layer, so a run is
repeatable and two policies with the same seed drop the same entries (kvpress ``RandomPress`` with a seed re-seeds
at every layer; its leaderboard entry draws from the global stream seeded once with 42, which cannot be reproduced
outside its process). No window, no sinks. While the answer is written the cut's position joins the seed, so that
successive cuts of a cache of the same size draw afresh.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class Random(ScoringPolicy):
    name = "random"
    summary = "uniform random scores per KV head (seeded by seed and layer)"
    seed: int = 0

    def score(self, stats: LayerStats) -> torch.Tensor:
        seed = self.seed * 1_000_003 + stats.layer + (7_919 * stats.end if stats.end is not None else 0)
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(stats.num_kv_heads, stats.context_len, generator=generator)
