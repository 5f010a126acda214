"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least like the average key.

Rule, per layer and KV head: the anchor a = mean over all positions of the L2-normalised (post-RoPE) keys, not
normalised again; score = −cos(k, a), so the most dissimilar keys are kept (kvpress ``KeyDiffPress``, one shot over
the whole prompt; the paper's block-wise variant is not this policy). No window, no sinks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pkvbench.policies.base import LayerStats, ScoringPolicy


@dataclass(frozen=True)
class KeyDiff(ScoringPolicy):
    name = "keydiff"
    summary = "keep the keys least similar (cosine) to the mean normalised key"
    reads_entries = True  # the cached keys themselves (a latent (MLA) cache has none per head: refused)

    def score(self, stats: LayerStats) -> torch.Tensor:
        keys = stats.keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1, eps=1e-8)
