"""Knorm (Devoto et al., 2024, arXiv 2406.11430): keys with a small L2 norm draw the most attention.

Rule, per layer and KV head: score = −‖k‖₂ of each cached (post-RoPE) key, so the keys with the smallest norms are
kept (kvpress ``KnormPress``: no window, no sinks). RoPE is a rotation: pre- and post-RoPE norms are the same.

Equal norms are common: in layer 0 every occurrence of a token has the same key before RoPE, so the same norm. By
default the earlier position wins such a tie (``ties=stable``, the same on every machine); kvpress ranks with
``torch.topk``, which the ``kvpress`` preset takes (``ties=topk``: kept sets identical to ``KnormPress``'s,
``docs/kvpress-crosscheck.md``).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class Knorm(ScoringPolicy):
    name = "knorm"
    summary = "keep the keys with the smallest L2 norm"
    reads_entries = True  # the cached keys themselves (a latent (MLA) cache has none per head: refused)
    kvpress_options: ClassVar[dict[str, object]] = {"ties": "topk"}

    def score(self, stats: LayerStats) -> torch.Tensor:
        return -stats.keys.float().norm(dim=-1)
