"""Full cache: keep every prompt entry. The reference every other policy is measured against."""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Policy, keep_all


@dataclass(frozen=True)
class FullCache(Policy):
    name = "full"
    summary = "keep all T prompt entries (no compression)"
    in_default_grid = True

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return [context_len] * num_layers

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        return keep_all(stats.context_len, stats.num_kv_heads)

    def decoding_refusal(self) -> str | None:
        return None  # the reference at every decode budget: nothing is ever cut

    def select_while_decoding(self, stats: LayerStats, k: int, buffer: int) -> torch.Tensor:
        return keep_all(stats.context_len, stats.num_kv_heads)
