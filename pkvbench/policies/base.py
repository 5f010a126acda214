"""What every policy shares: the statistics a prefill leaves behind, and the common selection rule.

A policy is a frozen dataclass of its options. Given one layer's statistics and that layer's budget k (entries per
KV head), ``keep`` returns the kept positions per KV head as a sorted ``LongTensor[num_kv_heads, k]``. No model, no
I/O: every rule can be tested on hand-made tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pkvbench import budgets


@dataclass(frozen=True)
class LayerStats:
    """One layer's prefill statistics, float32, batch dimension dropped.

    ``window_scores[w]`` is ``[num_query_heads, T]``: for each key position, the sum over the last ``w`` prompt
    queries of their causal softmax attention to it. ``accumulated`` is the same sum over all T prompt queries.
    Either is present only when a requested policy needs it.
    """

    context_len: int
    num_kv_heads: int
    window_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulated: torch.Tensor | None = None


def group_by_kv_head(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Fold ``[num_query_heads, T]`` scores to ``[num_kv_heads, T]``.

    Query head h reads KV head ``h // group`` (transformers' ``repeat_kv`` layout), so selecting per KV head lets the
    stored cache shrink for grouped-query attention.
    """
    num_query_heads, length = scores.shape
    grouped = scores.view(num_kv_heads, num_query_heads // num_kv_heads, length)
    return grouped.amax(dim=1) if how == "max" else grouped.mean(dim=1)


def top_positions(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores per row. Ties go to the earlier position (a stable sort), so the
    choice is deterministic even on the plateaus a max-pool creates."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :count]


def keep_window_plus_top(prefix_scores: torch.Tensor, k: int, window: int, context_len: int) -> torch.Tensor:
    """Keep the last ``window`` positions and the top ``k - window`` of the positions before them.

    ``prefix_scores`` is ``[num_kv_heads, context_len - window]``. Returns sorted ``[num_kv_heads, k]`` indices.
    """
    heads = prefix_scores.shape[0]
    recent = torch.arange(context_len - window, context_len, device=prefix_scores.device).expand(heads, window)
    chosen = torch.cat([top_positions(prefix_scores, k - window), recent], dim=1)
    return chosen.sort(dim=-1).values


def keep_all(stats: LayerStats, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(stats.context_len, device=device).expand(stats.num_kv_heads, stats.context_len)


@dataclass(frozen=True)
class Policy:
    """Base class: uniform per-layer budgets; subclasses give ``name`` and ``keep``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # Option values a user may pass, for those options that take a fixed set of words.
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __post_init__(self) -> None:
        for option, allowed in self.choices.items():
            if getattr(self, option) not in allowed:
                raise ValueError(f"{self.name}: {option} must be one of {', '.join(allowed)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{self.name}: {f.name} must not be negative")

    # --- what the prefill must record for this policy -------------------------------------------------------
    @property
    def windows_needed(self) -> set[int]:
        return set()

    @property
    def needs_accumulated(self) -> bool:
        return False

    # --- budgets ---------------------------------------------------------------------------------------------
    @property
    def min_budget(self) -> int:
        """The fewest entries per layer this rule can keep (e.g. its window); smaller budgets are raised to it."""
        return 1

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return budgets.uniform(k, context_len, num_layers)

    # --- selection -------------------------------------------------------------------------------------------
    def keep(self, stats: LayerStats, k: int) -> torch.Tensor:
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


def _format(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
