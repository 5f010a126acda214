"""TOVA (Oren et al., 2024, arXiv 2401.06104): the last token's attention decides.

Rule, per layer: the causal softmax attention of the prompt's last query over all positions, averaged over *all*
query heads (not per group), the same scores for every KV head; the last position is always kept. This is kvpress's
``TOVAPress``: TOVA applied once at the end of the prefill (the paper evicts one token per decoding step under a
fixed budget). With the question after compression the last token is the context's.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Needs, ScoringPolicy


@dataclass(frozen=True)
class TOVA(ScoringPolicy):
    name = "tova"
    summary = "last query's attention averaged over all heads; the last position always kept"

    @property
    def needs(self) -> Needs:
        return Needs(windows=frozenset({1}))

    @property
    def keeps_recent(self) -> int:
        return 1

    def score(self, stats: LayerStats) -> torch.Tensor:
        return stats.window(1).mean(dim=0, keepdim=True).expand(stats.num_kv_heads, -1)
