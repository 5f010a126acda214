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

from pkvbench.cell import budgets
from pkvbench.config import option_text


@dataclass(frozen=True)
class Needs:
    """What the prefill must record for a policy (the union over a grid's policies is recorded once)."""

    windows: frozenset[int] = frozenset()  # the last-w queries' attention sums, for each w
    accumulated: bool = False  # every query's causal attention sums (H2O)
    # Every query's attention sums where only the last w×w block is causal (the reference H2O of 2024-10 to 2026-06),
    # for each w.
    bidirectional: frozenset[int] = frozenset()
    # Statistics of the queries (pre-RoPE mean and covariance from position s on, rotated to the average of the next
    # f positions), for each (s, f): Expected Attention's.
    query_stats: frozenset[tuple[int, int]] = frozenset()
    # Scores of a pass that asks the model to repeat the prompt (KVzip), for each chunk size.
    reconstruction: frozenset[int] = frozenset()
    # The last w post-RoPE queries themselves, for each w (R-KV computes its own attention from them; a cache cut
    # while the answer is written scores with the answer's latest queries).
    queries: frozenset[int] = frozenset()
    # The mean and covariance of the pre-RoPE queries from position s on, not yet rotated, for each s (Expected
    # Attention while the answer is written: rotated to the positions after each cut).
    query_moments: frozenset[int] = frozenset()
    # The layer's attention output projection's weight (CriticalKV weighs each value by what it adds to the output):
    # read only for a policy that asks, since a model placed over devices may keep it offloaded, on the CPU or disk.
    output_weights: bool = False

    def __or__(self, other: Needs) -> Needs:
        """Everything either needs (flags or'ed, sets joined)."""
        return Needs(**{f.name: getattr(self, f.name) | getattr(other, f.name) for f in dataclasses.fields(self)})

    @property
    def attention_weights(self) -> str:
        """Which attention weights the policy needs, a cost of its own: kernels such as FlashAttention and paged
        serving engines return none. ``none``; ``window`` (the last queries' softmax, recomputed from their queries
        and the keys); ``all`` (every query's: the whole T×T attention, in chunks); ``repeat pass`` (a second pass's,
        KVzip's)."""
        if self.accumulated or self.bidirectional:
            return "all"
        if self.reconstruction:
            return "repeat pass"
        return "window" if self.windows else "none"

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
    num_query_heads: int | None = None  # None: as many as KV heads
    layer: int = 0
    window_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulated: torch.Tensor | None = None
    bidirectional: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # The layer's output projection weight ``[hidden, num_query_heads * head_dim]`` (value-norm-weighted scores)
    output_weight: torch.Tensor | None = None
    # (s, f) → (mean ``[num_query_heads, head_dim]``, covariance ``[num_query_heads, head_dim, head_dim]``) of future
    # queries (``Needs.query_stats``)
    query_stats: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # chunk size → ``[num_kv_heads, T]`` reconstruction scores (``Needs.reconstruction``)
    reconstruction: dict[int, torch.Tensor] = field(default_factory=dict)
    # ``[num_query_heads, w, head_dim]``: the last queries (post-RoPE), those of the last w entries' own tokens, for
    # the largest w in ``Needs.queries`` (fewer when the prompt is shorter)
    recent_queries: torch.Tensor | None = None
    # s → (mean ``[num_query_heads, head_dim]``, covariance) of the pre-RoPE queries from s on (``Needs.query_moments``)
    query_moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # While the answer is written the entries are a cache's, not a prompt's: their original positions
    # ``[heads, T]`` (None: 0 … T−1) and the position of the token to come (None: T).
    positions: torch.Tensor | None = None
    end: int | None = None

    @property
    def query_heads(self) -> int:
        return self.num_query_heads or self.num_kv_heads

    def window(self, w: int) -> torch.Tensor:
        if w not in self.window_scores:
            raise StatisticNotRecorded(f"the last-{w} window's attention was not recorded; declare it in `needs`")
        return self.window_scores[w]

    def accumulated_attention(self) -> torch.Tensor:
        if self.accumulated is None:
            raise StatisticNotRecorded("accumulated attention was not recorded; declare it in `needs`")
        return self.accumulated

    def future_queries(self, sink: int, future: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (sink, future) not in self.query_stats:
            raise StatisticNotRecorded(
                f"query statistics ({sink}, {future}) were not recorded; declare them in `needs`"
            )
        return self.query_stats[sink, future]

    def reconstruction_scores(self, chunk: int) -> torch.Tensor:
        if chunk not in self.reconstruction:
            raise StatisticNotRecorded(
                f"reconstruction scores (chunk {chunk}) were not recorded; declare them in `needs`"
            )
        return self.reconstruction[chunk]

    def last_queries(self, w: int) -> torch.Tensor:
        """``[num_query_heads, min(w, T), head_dim]``: the last w queries (post-RoPE)."""
        if self.recent_queries is None or self.recent_queries.shape[1] < min(w, self.context_len):
            raise StatisticNotRecorded(f"the last {w} queries were not recorded; declare them in `needs`")
        return self.recent_queries[:, -min(w, self.context_len) :]

    def entry_positions(self) -> torch.Tensor:
        """``[heads or 1, T]``: each entry's original position (a prompt's: 0 … T−1)."""
        if self.positions is None:
            return torch.arange(self.context_len)[None]
        return self.positions

    @property
    def next_position(self) -> int:
        """The position of the token to come: T after a prompt, later while the answer is written."""
        return self.context_len if self.end is None else self.end

    def output_projection(self) -> torch.Tensor:
        """``[hidden, num_query_heads * head_dim]``: the layer's attention output projection's weight, where the model
        keeps it (another device than the entries' where the model is placed over several: move what is read)."""
        if self.output_weight is None:
            raise StatisticNotRecorded("the output projection's weight was not given; declare it in `needs`")
        return self.output_weight

    def bidirectional_attention(self, w: int) -> torch.Tensor:
        if w not in self.bidirectional:
            raise StatisticNotRecorded(f"window-{w} bidirectional attention was not recorded; declare it in `needs`")
        return self.bidirectional[w]


# How query heads' scores become a kept set (grouped-query attention). Query head h reads KV head ``h // group``
# (transformers' ``repeat_kv`` layout).
#   mean, max: fold each group's scores (after any pooling) and keep one set per KV head: the cache really shrinks.
#   query:     no fold: each query head keeps its own set, and the cache holds one set per query head — what the
#              PyramidKV paper's code does (it repeats keys and values to every query head before compressing).
GQA_MODES = ("mean", "max", "query")


def group_by_kv_head(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Fold ``[num_query_heads, T]`` scores to ``[num_kv_heads, T]`` by ``how`` (mean or max); ``query`` keeps them."""
    if how == "query":
        return scores
    num_query_heads, length = scores.shape
    grouped = scores.view(num_kv_heads, num_query_heads // num_kv_heads, length)
    return grouped.amax(dim=1) if how == "max" else grouped.mean(dim=1)


# Which of several equal scores wins the last places of a top-k:
#   stable: the earlier position (a stable sort), so the choice is the same on every machine;
#   topk:   whatever torch.topk returns (backend-defined), as the reference code does.
TIE_ORDERS = ("stable", "topk")


def best_positions(scores: torch.Tensor, count: int, ties: str = "stable") -> torch.Tensor:
    """Indices of the ``count`` highest scores per row (in no particular order)."""
    if ties == "topk":
        return torch.topk(scores, count, dim=-1).indices
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :count]


def top_mask(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` highest of all heads' scores together, as a keep mask (ties to the earlier head, position)."""
    flat = torch.sort(scores.flatten(), descending=True, stable=True).indices[:count]
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[flat] = True
    return mask.view_as(scores)


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
    # Integer options that must be odd: pooling kernels (stride 1, same padding), so that pooling keeps every position.
    odd: ClassVar[tuple[str, ...]] = ()
    # Part of ``pkvbench run``'s default --policy list (the paper's five).
    in_default_grid: ClassVar[bool] = False
    # The options that make this rule select as the PyramidKV paper's code does (``--protocol reference``); an
    # option the user sets wins over them.
    reference_options: ClassVar[dict[str, object]] = {}
    # The options that make this rule select as NVIDIA kvpress's press of the same rule (``--protocol kvpress``),
    # where pkvbench's defaults differ on purpose; an option the user sets wins over them.
    kvpress_options: ClassVar[dict[str, object]] = {}

    def __post_init__(self) -> None:
        # A subclass's choices, positive and odd options add to its bases'.
        choices = {k: v for cls in reversed(type(self).__mro__) for k, v in vars(cls).get("choices", {}).items()}
        positive = {name for cls in type(self).__mro__ for name in vars(cls).get("positive", ())}
        odd = {name for cls in type(self).__mro__ for name in vars(cls).get("odd", ())}
        for option, allowed in choices.items():
            if getattr(self, option) not in allowed:
                raise ValueError(f"{self.name}: {option} must be one of {', '.join(allowed)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{self.name}: {f.name} must be a finite number")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                floor = 1 if f.name in positive else 0
                if value < floor:
                    raise ValueError(f"{self.name}: {f.name} must be at least {floor}")
                if f.name in odd and value % 2 == 0:
                    raise ValueError(f"{self.name}: {f.name} must be odd so that pooling keeps every position")

    @property
    def needs(self) -> Needs:
        """What the prefill must record for this policy."""
        return Needs()

    @property
    def reads_entries(self) -> bool:
        """Whether the rule reads the cached keys or values themselves (``stats.keys``, ``stats.values``), not only
        attention: a latent (MLA) cache has no per-head keys or values to give it, and refuses it."""
        return False

    # --- budgets ---------------------------------------------------------------------------------------------
    @property
    def min_budget(self) -> int:
        """The fewest entries per layer this rule can keep (e.g. its window); smaller budgets are raised to it."""
        return 1

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return budgets.uniform(k, context_len, num_layers)

    # --- selection -------------------------------------------------------------------------------------------
    @property
    def per_query_head(self) -> bool:
        """Whether it keeps one set per query head (``gqa=query``, the reference protocol's), not one per KV head."""
        return getattr(self, "gqa", None) == "query"

    def cache_heads(self, stats: LayerStats) -> int:
        """Kept sets per layer (rows of ``select``): one per KV head, or one per query head (``per_query_head``)."""
        return stats.query_heads if self.per_query_head else stats.num_kv_heads

    def query_sets(self, query_heads: int) -> int | None:
        """The kept sets of every layer where this policy keeps one per query head: ``query_heads``; None where it
        keeps one per KV head, as many as each layer has (Gemma 4's local and global layers differ)."""
        return query_heads if self.per_query_head else None

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        """Sorted kept positions ``[heads, min(k, T)]`` — or, for a policy whose heads keep different numbers of
        entries, a keep mask ``[heads, T]`` with heads·k kept in all."""
        raise NotImplementedError

    def select_layers(self, stats: list[LayerStats], budgets: list[int]) -> list[torch.Tensor]:
        """``select`` for several layers at once (the compressed ones): a policy that shares its budget across
        layers (KVzip) chooses them together."""
        return [self.select(layer_stats, k) for layer_stats, k in zip(stats, budgets)]

    # --- while the answer is written (``--decode-budget``, ``engine/shrinking.py``) ----------------------------
    def decoding_refusal(self) -> str | None:
        """None if this policy can cut a cache while the answer is written; else why not, in one line."""
        return f"{self.name} cannot score a cache while the answer is written (it has no decode-time rule)"

    @property
    def decoding_needs(self) -> Needs:
        """What a cut while the answer is written needs: the same statistics as at the prefill, of the cache's
        entries, with the answer's latest queries as the observation window."""
        return self.needs

    def select_while_decoding(self, stats: LayerStats, k: int, buffer: int) -> torch.Tensor:
        """Sorted kept columns ``[heads, min(k, T)]`` of a cache of T entries (``stats``: its entries as if they
        were a prompt, ``end`` the position to come) cut to k per head, the newest ``buffer`` always among them."""
        raise NotImplementedError

    # --- naming ----------------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """``name`` plus every option that differs from its default, e.g. ``snapkv:window=32``."""
        changed = [
            f"{f.name}={option_text(getattr(self, f.name))}"
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

    choices: ClassVar[dict[str, tuple[str, ...]]] = {"ties": TIE_ORDERS}
    ties: str = "stable"

    @property
    def keeps_recent(self) -> int:
        """How many of the last positions are always kept (an observation window); 0 by default."""
        return 0

    @property
    def min_budget(self) -> int:
        return max(self.keeps_recent, 1)

    @property
    def score_scale(self) -> float:
        """How many times the score of kvpress's press of the same rule this policy's score is (1: the same scale;
        SnapKV sums its window's attention where kvpress averages it). A rule that adds a constant to the scores
        (CriticalKV's epsilon) scales it by this, so that the constant means what it means in kvpress."""
        return 1.0

    def score(self, stats: LayerStats) -> torch.Tensor:
        """``[heads, T]``: higher means more worth keeping, one row per kept set (``cache_heads``). The last
        ``keeps_recent`` positions are kept anyway: their scores are ignored and may be left out (``[heads, T - r]``)."""
        raise NotImplementedError

    def select(self, stats: LayerStats, k: int) -> torch.Tensor:
        return self._select(stats, k, self.keeps_recent)

    def decoding_refusal(self) -> str | None:
        if self.per_query_head:
            return (
                f"{self.label}: a cache of one set per query head (gqa=query) cannot be cut while the answer is written"
            )
        return None

    def select_while_decoding(self, stats: LayerStats, k: int, buffer: int) -> torch.Tensor:
        """The prefill's rule on the cache's entries, with the newest max(``keeps_recent``, ``buffer``) kept."""
        return self._select(stats, k, max(self.keeps_recent, buffer))

    def _select(self, stats: LayerStats, k: int, recent: int) -> torch.Tensor:
        """The top k − r positions by score before the last r, plus the last r (r = min(``recent``, k))."""
        length = stats.context_len
        if k >= length:
            return keep_all(length, self.cache_heads(stats))
        scores = self.score(stats).float()
        recent = min(recent, k)
        chosen = best_positions(scores[:, : length - recent], k - recent, self.ties)
        window = torch.arange(length - recent, length, device=chosen.device).expand(chosen.shape[0], recent)
        return torch.cat([chosen, window], dim=1).sort(dim=-1).values


@dataclass(frozen=True)
class WindowedPolicy(ScoringPolicy):
    """A scoring policy with an observation window: its last ``window`` positions (at least 1) are always kept, and
    the rule reads what they attend to (SnapKV, H2O's ``scores=window``, R-KV)."""

    positive: ClassVar[tuple[str, ...]] = ("window",)
    window: int = 8

    @property
    def keeps_recent(self) -> int:
        return self.window
