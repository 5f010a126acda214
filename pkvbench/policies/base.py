"""What every policy shares: the statistics a prefill leaves behind, what a policy asks it to record, and the one
selection rule of scoring policies.

A policy is a frozen dataclass of its options. Given one layer's statistics and that layer's budget k (entries per
cache head), ``select`` returns the kept positions per cache head as a sorted ``LongTensor[heads, k]``. No model, no
I/O: every rule can be tested on hand-made tensors.

Most policies are *scoring* policies (kvpress's ``ScorerPress`` idea): they say how much each position is worth,
``score(stats) -> [heads, T]``, and ``ScoringPolicy.select`` does the rest once for all of them: nothing is dropped
when k ≥ T, the last ``keeps_recent`` positions (an observation window) are always kept, and the k best positions
per head are kept, ties going to the earlier position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pkvbench import budgets


@dataclass(frozen=True)
class Needs:
    """What the prefill must record for a policy (the union over a grid's policies is recorded once)."""

    windows: frozenset[int] = frozenset()  # the last-w queries' attention sums, for each w
    accumulated: bool = False  # every query's attention sums (H2O)

    def __or__(self, other: Needs) -> Needs:
        return Needs(windows=self.windows | other.windows, accumulated=self.accumulated or other.accumulated)

    @staticmethod
    def union(needs: Iterable[Needs]) -> Needs:
        total = Needs()
        for item in needs:
            total = total | item
        return total


class StatisticNotRecorded(LookupError):
    """A policy read a statistic it did not declare in ``needs``: a bug in the policy, caught by the contract test."""


@dataclass(frozen=True)
class LayerStats:
    """One layer's prefill statistics, float32, batch dimension dropped.

    ``window_scores[w]`` is ``[num_query_heads, T]``: for each key position, the sum over the last ``w`` prompt
    queries of their causal softmax attention to it. ``accumulated`` is the same sum over all T prompt queries.
    ``keys`` and ``values`` are the layer's cached ``[num_kv_heads, T, head_dim]`` entries (keys after RoPE), there
    for policies that score the entries themselves. Each statistic is present only when a policy needs it.
    """

    context_len: int
    num_kv_heads: int
    window_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulated: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def window(self, w: int) -> torch.Tensor:
        if w not in self.window_scores:
            raise StatisticNotRecorded(f"the last-{w} window's attention was not recorded; declare it in `needs`")
        return self.window_scores[w]

    def accumulated_attention(self) -> torch.Tensor:
        if self.accumulated is None:
            raise StatisticNotRecorded("accumulated attention was not recorded; declare it in `needs`")
        return self.accumulated


def group_by_kv_head(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Fold ``[num_query_heads, T]`` scores to ``[num_kv_heads, T]``.

    Query head h reads KV head ``h // group`` (transformers' ``repeat_kv`` layout), so selecting per KV head lets the
    stored cache shrink for grouped-query attention.
    """
    num_query_heads, length = scores.shape
    grouped = scores.view(num_kv_heads, num_query_heads // num_kv_heads, length)
    return grouped.amax(dim=1) if how == "max" else grouped.mean(dim=1)


def top_positions(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indices of the ``count`` highest scores per row. Ties go to the earlier position (a stable sort), so
    the choice is deterministic even on the plateaus a max-pool creates."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :count].sort(dim=-1).values


def keep_all(length: int, heads: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(length, device=device).expand(heads, length)


@dataclass(frozen=True)
class Policy:
    """Base class: uniform per-layer budgets; subclasses give ``name``, ``summary`` and ``select``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # Option values a user may pass, for those options that take a fixed set of words.
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Integer options that must be at least 1 (a window of 0 queries has no attention to sum).
    positive: ClassVar[tuple[str, ...]] = ()
    # Part of ``pkvbench run``'s default --policy list (the paper's five).
    in_default_grid: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for option, allowed in self.choices.items():
            if getattr(self, option) not in allowed:
                raise ValueError(f"{self.name}: {option} must be one of {', '.join(allowed)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{self.name}: {f.name} must be a finite number")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                floor = 1 if f.name in self.positive else 0
                if value < floor:
                    raise ValueError(f"{self.name}: {f.name} must be at least {floor}")

    @property
    def needs(self) -> Needs:
        """What the prefill must record for this policy."""
        return Needs()

    # --- budgets ---------------------------------------------------------------------------------------------
    @property
    def min_budget(self) -> int:
        """The fewest entries per layer this rule can keep (e.g. its window); smaller budgets are raised to it."""
        return 1

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return budgets.uniform(k, context_len, num_layers)

    # --- selection -------------------------------------------------------------------------------------------
    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        """Sorted kept positions ``[heads, min(k, T)]``."""
        raise NotImplementedError

    # --- naming ----------------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """``name`` plus every option that differs from its default, e.g. ``snapkv:window=32``."""
        changed = [
            f"{f.name}={_format(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return ":".join([self.name, *changed])

    @property
    def options(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ScoringPolicy(Policy):
    """A policy that scores positions; the selection from scores is this class's, the same for all."""

    @property
    def keeps_recent(self) -> int:
        """How many of the last positions are always kept (an observation window); 0 by default."""
        return 0

    @property
    def min_budget(self) -> int:
        return max(self.keeps_recent, 1)

    def score(self, stats: LayerStats) -> torch.Tensor:
        """``[heads, T]``: higher means more worth keeping. ``heads`` is the layer's KV heads (one kept set per KV
        head). Scores of the last ``keeps_recent`` positions are ignored: those are kept anyway."""
        raise NotImplementedError

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        length = stats.context_len
        if k >= length:
            return keep_all(length, stats.num_kv_heads)
        scores = self.score(stats).float()
        recent = min(self.keeps_recent, k)
        if recent:
            scores = scores.clone()
            scores[:, length - recent :] = float("inf")
        return top_positions(scores, k)


def _format(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
