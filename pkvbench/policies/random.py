"""Random: every position a uniform random score — the floor any informed policy must beat.

Rule, per layer and KV head: i.i.d. uniform scores from a generator seeded by ``seed`` and the layer, so a run is
repeatable, two policies with the same seed drop the same entries, and the layers drop different ones. kvpress's
``RandomPress(seed=s)`` instead re-seeds with s at every layer, so every layer draws the same scores: that is
``per_layer=false`` (in the ``kvpress`` preset; kept sets identical, ``docs/kvpress-crosscheck.md``). kvpress's
leaderboard entry, ``RandomPress()``, draws from the global stream seeded once with 42, which cannot be reproduced
outside its process. No window, no sinks. While the answer is written the cut's position joins the seed, so that
successive cuts of a cache of the same size draw afresh.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.config import SEED_MAX
from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class Random(ScoringPolicy):
    name = "random"
    summary = "uniform random scores per KV head (seeded by seed and layer)"
    kvpress_options: ClassVar[dict[str, object]] = {"per_layer": False}
    seed: int = 0
    per_layer: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed > SEED_MAX:  # the generator's seed is seed·1000003 + layer + 7919·position: 64 bits in all
            raise ValueError(f"{self.name}: seed must be at most {SEED_MAX}, as --seed")

    def score(self, stats: LayerStats) -> torch.Tensor:
        seed = self.seed * 1_000_003 + stats.layer if self.per_layer else self.seed
        seed += 7_919 * stats.end if stats.end is not None else 0  # a decode-time cut: its position draws afresh
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(stats.num_kv_heads, stats.context_len, generator=generator)
