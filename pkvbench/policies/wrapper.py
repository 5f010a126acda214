"""What policies built on another policy's scores share (``adakv(snapkv)``, ``chunkkv(snapkv)``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pkvbench.config import option_text
from pkvbench.policies.base import LayerStats, Needs, Policy, ScoringPolicy


def full_scores(policy: ScoringPolicy, stats: LayerStats, pinned: str = "inf") -> torch.Tensor:
    """``[heads, T]`` scores of a scoring policy with what it always keeps (its recent window) at +inf, or with
    ``pinned="max+1"`` at the highest other score + 1 (kvpress's SnapKV pads its window so: the same top-k, but a
    mean over a span only partly in the window stays finite)."""
    scores = policy.score(stats).float()
    length = stats.context_len
    if scores.shape[1] < length:  # the policy left out the window's scores
        scores = torch.cat([scores, scores.new_zeros(scores.shape[0], length - scores.shape[1])], dim=1)
    else:
        scores = scores.clone()
    if policy.keeps_recent:
        scored = length - policy.keeps_recent
        if pinned == "inf":
            scores[:, scored:] = float("inf")
        else:  # a reduction over the layer's scores: only where asked for
            scores[:, scored:] = (float(scores[:, :scored].max()) if scored > 0 else 0.0) + 1
    return scores


@dataclass(frozen=True)
class Wrapper(Policy):
    """A policy built on a scoring policy's scores (``name(inner)``): it records what the inner policy needs and
    takes its per-layer budgets and floor; it chooses per KV head, so the inner policy cannot keep query heads."""

    wraps: ClassVar[bool] = True
    inner: ScoringPolicy | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.inner, ScoringPolicy):
            raise ValueError(f"{self.name} wraps a scoring policy: write {self.name}(snapkv), {self.name}(knorm), …")
        if self.inner.per_query_head:
            raise ValueError(f"{self.name} chooses per KV head: its inner policy cannot keep one set per query head")

    @property
    def needs(self) -> Needs:
        return self.inner.needs

    @property
    def reads_entries(self) -> bool:
        return self.inner.reads_entries

    def decoding_refusal(self) -> str | None:
        return (
            f"{self.name}({self.inner.label}) cannot cut a cache while the answer is written (a prefill-only wrapper)"
        )

    @property
    def min_budget(self) -> int:
        return self.inner.min_budget

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return self.inner.layer_budgets(k, context_len, num_layers)

    @property
    def label(self) -> str:
        """``name(inner label)`` plus the wrapper's own options that differ from their defaults."""
        own = [f for f in dataclasses.fields(self) if f.name != "inner"]
        changed = [f"{f.name}={option_text(getattr(self, f.name))}" for f in own if getattr(self, f.name) != f.default]
        return ":".join([f"{self.name}({self.inner.label})", *changed])
