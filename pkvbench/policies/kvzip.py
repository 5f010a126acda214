"""KVzip (Kim et al., 2025, arXiv 2505.23416): keep what the model needs to reconstruct the context.

Scores come from a pass of their own (``engine/reconstruction.py``): the model is asked to repeat the prompt, chunk
by chunk, after the prompt's own chat prefix and with the answer's opening its template gives, and each entry scores
the most attention any query of its KV head's group pays it meanwhile — the scores of kvpress's ``KVzipPress`` on
the same conversation, to float rounding (``docs/kvpress-crosscheck.md``). Selection is head-wise and, by default,
shared across layers (``layerwise=False``, kvpress's default): of all layers', heads' and positions' scores together,
the top Σ_l H·k_l are kept, so both layers and heads keep different numbers of entries; ``layerwise=true`` keeps each
layer's top H·k over its heads. No floor per head (KVzip "does not rely on safeguards"). Query-agnostic by
construction; with the question in the compressed prompt it is repeated too.

Where kvpress differs, on purpose:

- **The chat prefix is kept** (the system message and the user turn's opening), as the authors keep their system
  prompt; kvpress scores only the context past it and keeps the first 4 positions (sinks), so the prefix's other
  tokens score 0 and go first.
- **The count.** At the compression ratio r (budget ``cr<r>``) pkvbench keeps Σ_l H·int(T·(1 − r)) entries (k per
  KV head per layer on average, as every policy at that budget); kvpress prunes int(L·H·T·r) of the L·H·T entries
  over all layers and keeps the rest: up to L·H more (its layerwise mode prunes int(H·T·r) per layer).
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Needs, Policy, keep_all, top_mask


@dataclass(frozen=True)
class KVzip(Policy):
    name = "kvzip"
    summary = "attention received while the model repeats the prompt (an extra pass); head- and layer-adaptive"
    positive = ("chunk",)
    chunk: int = 2048
    layerwise: bool = False

    @property
    def needs(self) -> Needs:
        return Needs(reconstruction=frozenset({self.chunk}))

    def decoding_refusal(self) -> str | None:
        return (
            "kvzip cannot cut a cache while the answer is written: its scores come from a pass that repeats the prompt"
        )

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        if k >= stats.context_len:
            return keep_all(stats.context_len, stats.num_kv_heads)
        return top_mask(stats.reconstruction_scores(self.chunk).float(), stats.num_kv_heads * k)

    def select_layers(self, stats: list[LayerStats], budgets: list[int]) -> list[torch.Tensor]:
        if self.layerwise or not stats:
            return super().select_layers(stats, budgets)
        # [L, H, T], on the first layer's device (a model placed over several devices: the scores move, not the cache)
        device = stats[0].reconstruction_scores(self.chunk).device
        scores = torch.stack([s.reconstruction_scores(self.chunk).to(device, torch.float32) for s in stats])
        kept = top_mask(scores.flatten(0, 1), sum(s.num_kv_heads * k for s, k in zip(stats, budgets)))
        return list(kept.view_as(scores))
