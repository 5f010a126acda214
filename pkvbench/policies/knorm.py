"""Knorm (Devoto et al., 2024, arXiv 2406.11430): keys with a small L2 norm draw the most attention.

Rule, per layer and KV head: score = −‖k‖₂ of each cached (post-RoPE) key, so the keys with the smallest norms are
kept (kvpress ``KnormPress``: no window, no sinks). RoPE is a rotation: pre- and post-RoPE norms are the same.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class Knorm(ScoringPolicy):
    name = "knorm"
    summary = "keep the keys with the smallest L2 norm"

    def score(self, stats: LayerStats) -> torch.Tensor:
        return -stats.keys.float().norm(dim=-1)
