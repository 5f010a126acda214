"""AdaKV (Feng et al., 2024, arXiv 2407.11550): one budget per layer, shared unequally by its KV heads.

A wrapper over any scoring policy (``adakv(snapkv)``, ``adakv(pyramidkv)``): the layer keeps k entries per KV head on
average, H·k in all, chosen as the top H·k of the inner policy's scores over all heads and positions together, so
heads whose scores are concentrated give up room to heads whose scores are spread. Each head first keeps its own top
``alpha``·k (the safeguard floor) and whatever the inner policy always keeps (its window). This is kvpress's
``AdaKVPress`` (``alpha_safeguard=0.2``; the authors' code, FFY0/AdaKV, blends the floor into each head's share
instead: B_h = round(α·B + (1 − α)·c_h)).

``critical=true`` is CriticalKV (Feng et al., 2025, arXiv 2502.03805; kvpress ``CriticalAdaKVPress``): once each
head's budget B_h is set as above, it keeps its top ``first_stage_ratio``·B_h entries by the inner score and fills
the rest by (score + ``epsilon``) × ‖v·W_o‖₁, the L1 norm of the entry's value through the head's slice of the
output projection (averaged over the group's query heads) — what an entry can add to the layer's output. (kvpress
marks both stages' picks with a sentinel score and evicts the global bottom; here each stage is an explicit top-k
within the head's budget, so the budget is met exactly.) ``epsilon`` is in the units of kvpress's score of the inner
rule: it is multiplied by the inner policy's ``score_scale`` (SnapKV's window, whose score sums the window's attention
where kvpress's averages it), so ``adakv(snapkv):critical=true`` with kvpress's SnapKV options keeps the sets of
kvpress's ``CriticalAdaKVPress(SnapKVPress())`` (``docs/kvpress-crosscheck.md``).

Heads keep different numbers of entries: ``select`` returns a keep mask ``[heads, T]``; the cache stores each layer
padded to its fullest head, masked (``kv_bytes`` counts the padding, ``kv_entries`` what is kept).
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Needs, keep_all, top_mask
from pkvbench.policies.wrapper import Wrapper, full_scores


def value_output_norms(stats: LayerStats) -> torch.Tensor:
    """``[num_kv_heads, T]``: ‖v·W_o‖₁ per query head (its value head's entry through its slice of the output
    projection), averaged over each KV head's group."""
    values = stats.values.float()
    weight = stats.output_projection().to(values.device, torch.float32)  # an offloaded layer's is on the CPU
    query_heads, kv_heads = stats.query_heads, stats.num_kv_heads
    dim = values.shape[-1]
    per_head = weight.view(weight.shape[0], query_heads, dim).permute(1, 2, 0)  # [Hq, d, hidden]
    repeated = values.repeat_interleave(query_heads // kv_heads, dim=0)  # [Hq, T, d]
    norms = torch.bmm(repeated, per_head).abs().sum(dim=-1)  # [Hq, T]
    return norms.view(kv_heads, query_heads // kv_heads, -1).mean(dim=1)


@dataclass(frozen=True)
class AdaKV(Wrapper):
    name = "adakv"
    summary = "head-wise budgets: the layer's top H·k scores of the inner policy over all heads (floor alpha·k)"
    alpha: float = 0.2
    critical: bool = False
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    @property
    def needs(self) -> Needs:
        return self.inner.needs | Needs(output_weights=self.critical)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha <= 1 or not 0 <= self.first_stage_ratio <= 1:
            raise ValueError("adakv: alpha and first_stage_ratio are fractions (0..1)")

    @property
    def reads_entries(self) -> bool:
        return self.critical or self.inner.reads_entries  # CriticalKV weighs by the values

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        length, heads = stats.context_len, stats.num_kv_heads
        if k >= length:
            return keep_all(length, heads)
        scores = full_scores(self.inner, stats)
        floor = min(int(k * self.alpha), k)
        if floor:
            top = torch.topk(scores, floor, dim=-1).indices
            scores.scatter_(1, top, float("inf"))
        shares = top_mask(scores, heads * k).sum(dim=1)  # the layer's top H·k: how many fall in each head
        if not self.critical:
            return top_mask(scores, heads * k)
        norms = value_output_norms(stats)
        epsilon = self.epsilon * self.inner.score_scale  # in the inner policy's units, as kvpress's on its scores
        weighted = (scores.clamp(max=torch.finfo(torch.float32).max) + epsilon) * norms
        keep = torch.zeros_like(scores, dtype=torch.bool)
        for head in range(heads):
            first = int(int(shares[head]) * self.first_stage_ratio)
            order = torch.sort(scores[head], descending=True, stable=True).indices
            keep[head, order[:first]] = True
            rest = weighted[head].masked_fill(keep[head], float("-inf"))
            keep[head, torch.sort(rest, descending=True, stable=True).indices[: int(shares[head]) - first]] = True
        return keep
