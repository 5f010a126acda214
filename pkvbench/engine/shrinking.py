"""Compression while the answer is written (``--decode-budget``): caches that shrink as well as grow, per row.

A row with a ``DecodeSchedule`` has its cache cut back to at most ``target`` entries per KV head in every layer each
time its answer reaches a multiple of ``interval`` tokens: when token g is chosen (g = interval, 2·interval, …) the
cache — its kept prompt entries and the answer's tokens so far — is cut before token g is written. So while it is
written the cache holds at most target + interval entries per head (with interval 1: target + 1), and at the start
what the prefill kept plus the first interval − 1 tokens. The newest ``buffer`` entries are always kept; the others
by the policy's own rule applied to the cache's entries as if they were a prompt (``Policy.select_while_decoding``),
its observation window the answer's latest queries. Entries keep their original positions.

What a cut scores from is recorded while the batch decodes, only when a row of it needs it (``ShrinkingLayer``): the
last W post-RoPE queries of each row (a ring per layer, started with the prompt's last W from the prefill), and for
H2O each entry's attention summed over every query since the prompt (started with the prefill's sums). Expected
Attention's query statistics are the prompt's, rotated to the positions after each cut.

Rows of a batch cut on their own schedules; a row's numbers do not depend on the other rows (each cut reads and
rewrites only that row's entries), so a batch gives each row the tokens it gives alone (``tests/test_decoding.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pkvbench.cell import budgets
from pkvbench.engine.architecture import Architecture, LayerSoftmax
from pkvbench.engine.attention import attention_softmax, last_queries_sums, rotate_moments, soft_cap_
from pkvbench.engine.cache import RaggedCache, host_copy
from pkvbench.engine.sliding import PositionedLayer
from pkvbench.policies.base import LayerStats, Needs, Policy

# A row's trace (cache entries over the answer's tokens) keeps at most this many cuts, evenly spread.
TRACE_CUTS = 64


@dataclass(frozen=True)
class DecodeSchedule:
    """Cut a row's cache back to ``target`` entries per head (split over layers as the policy splits a budget, e.g.
    PyramidKV's pyramid) every ``interval`` new tokens, by ``policy``, the newest ``buffer`` entries always kept."""

    policy: Policy
    target: int
    interval: int
    buffer: int
    num_layers: int
    # Per layer: a mixed model's local layer's reach, or None. A local layer is never cut: it decodes under its
    # window from the entries it kept (``budgets.layer_budgets``).
    local: tuple[int | None, ...] = ()

    @classmethod
    def make(
        cls,
        policy: Policy,
        target: int,
        interval: int,
        buffer: int,
        num_layers: int,
        local: tuple[int | None, ...] = (),
    ) -> DecodeSchedule:
        return cls(policy, target, interval, buffer, num_layers, local)

    def targets(self, length: int) -> list[int]:
        """Each layer's entries per head after a cut when the sequence (prompt and answer so far) holds ``length``
        tokens: the policy's split of the target over a prompt of that length, as at the prefill (nothing is cut
        where the target holds the whole sequence, nor in a local layer)."""
        never_cut = tuple(None if reach is None else length for reach in self.local)
        return budgets.layer_budgets(self.policy, self.target, length, self.num_layers, never_cut)

    @property
    def cuts_nothing(self) -> bool:
        """A policy that keeps everything at any budget (the full cache): no cut ever."""
        return min(self.targets(1 << 40)) >= 1 << 40

    @property
    def needs(self) -> Needs:
        return self.policy.decoding_needs

    def room(self, stored: int) -> int:
        """Columns a row needs beyond ``stored`` (its entries at the start): its cache never holds more than
        max(stored, its largest layer target) + interval."""
        return max(0, max(self.targets(1 << 40)) - stored) + self.interval


def query_window(needs: Needs) -> int:
    """How many of the latest queries a policy's cuts read (its windows, or the queries it scores from)."""
    return max(needs.windows | needs.queries, default=0)


def prefill_needs(policy: Policy) -> Needs:
    """What the prefill must record so that ``policy`` can cut while the answer is written: its decode-time needs,
    the prompt's last queries (the first cuts' window) and its query statistics before rotation."""
    needs = policy.decoding_needs
    window = query_window(needs)
    return needs | Needs(
        queries=frozenset({window}) if window else frozenset(),
        query_moments=frozenset(sink for sink, _ in needs.query_stats),
    )


@dataclass
class DecodeStart:
    """What a row's cuts start from, per layer, for its kept prompt entries (from the prefill)."""

    queries: list[torch.Tensor] | None = None  # [Hq, w, d]: the prompt's (or context's) last queries
    accumulated: list[torch.Tensor] | None = None  # [Hq, n]: each kept entry's attention summed over the prompt
    moments: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None  # sink → pre-RoPE (mean, covariance)


def start_from(stats: list[LayerStats], positions: list[torch.Tensor], needs: Needs) -> DecodeStart:
    """A row's ``DecodeStart`` from the prefill's statistics and its kept entries' ``positions`` ``[H, n]``."""
    start = DecodeStart()
    if query_window(needs):
        start.queries = [s.recent_queries for s in stats]
    if needs.accumulated:
        start.accumulated = []
        for layer_stats, kept in zip(stats, positions):
            totals = layer_stats.accumulated_attention()
            by_query_head = kept.to(totals.device).repeat_interleave(totals.shape[0] // kept.shape[0], dim=0)
            start.accumulated.append(totals.gather(1, by_query_head))
    if needs.query_stats:
        start.moments = [s.query_moments for s in stats]
    return start


class ShrinkingLayer(PositionedLayer):
    """A ``PositionedLayer`` whose rows can also be cut (``keep``), and that records the latest queries
    (``query_window`` > 0) and accumulated attention (``accumulate``) as rows decode."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        room: int,
        kv_heads: int,
        positions: torch.Tensor,
        queries: torch.Tensor | None = None,
        query_counts=None,
        accumulated: torch.Tensor | None = None,
        start: int = 0,
        expand=None,
    ):
        """``positions`` ``[batch, heads, n]`` of the entries; ``queries`` ``[batch, Hq, W, d]`` the latest W
        queries, the last ``query_counts[b]`` of row b real (kept on the host, as the lengths are: a cut reads them
        without a sync); ``accumulated`` ``[batch, Hq, n]`` the sums so far; ``start`` the position of the first new
        token; ``expand``: a latent (MLA) layer's ``expand_kv`` — its cached latents and rotary keys → every head's
        keys and values (``engine/latent.py``) — None elsewhere."""
        super().__init__(keys, values, lengths, room, kv_heads, positions, start)
        self.expand = expand
        if self.group != 1:
            raise ValueError("a cache of one set per query head cannot be cut while the answer is written")
        capacity = self._key_store.shape[2]
        self._queries = queries
        self.query_counts = None if query_counts is None else host_copy(query_counts)
        self._accumulated = None
        if accumulated is not None:
            self._accumulated = accumulated.new_zeros((*accumulated.shape[:2], capacity))
            self._accumulated[:, :, : accumulated.shape[2]] = accumulated

    def _grow(self, longest: int) -> None:
        super()._grow(longest)
        if self._accumulated is not None:
            extra = self._key_store.shape[2] - self._accumulated.shape[2]
            self._accumulated = torch.nn.functional.pad(self._accumulated, (0, extra))

    def _attended(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The keys ``[..., H, n, d]`` attention reads of cached ``keys``/``values``: themselves, or a latent layer's
        expanded to every head."""
        return keys if self.expand is None else self.expand(keys, values)[0]

    def observe(self, query: torch.Tensor, softmax: LayerSoftmax) -> None:
        """Keep the latest queries, add their attention to each entry's sum (with the layer's scale, soft-cap and
        sinks, as its model turns logits into attention)."""
        new = query.shape[2]
        if self._queries is not None:
            width = self._queries.shape[2]
            self._queries = torch.cat([self._queries, query.float()], dim=2)[:, :, -width:]
            self.query_counts = np.minimum(self.query_counts + new, width)
        if self._accumulated is not None:
            batch, query_heads, _, dim = query.shape
            keys = self._attended(self.keys, self.values).float()  # [batch, H, columns, d]
            grouped = query.float().reshape(batch, keys.shape[1], query_heads // keys.shape[1] * new, dim)
            logits = (grouped @ keys.transpose(2, 3) * softmax.scaling).view(batch, query_heads, new, keys.shape[2])
            soft_cap_(logits, softmax.softcap)
            mask = self.attention_mask()
            if mask is not None:
                mask = mask.repeat_interleave(query_heads // mask.shape[1], dim=1)
                logits = logits.masked_fill(~mask, float("-inf"))
            self._accumulated[:, :, : keys.shape[2]] += attention_softmax(logits, softmax.sinks).sum(dim=2)

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        super().select_rows(rows, host_rows)
        if self._queries is not None:
            self._queries = self._queries[rows]
            self.query_counts = self.query_counts[host_copy(host_rows)]
        if self._accumulated is not None:
            self._accumulated = self._accumulated[rows]

    def row_stats(
        self, row: int, layer: int, needs: Needs, softmax: LayerSoftmax, end: int, query_heads: int
    ) -> LayerStats:
        """Row ``row``'s entries as a policy sees them at a cut (``end``: the position of the token to come;
        ``softmax``: the layer's, as its model turns logits into attention)."""
        count = int(self.host_lengths[row, 0])
        if not (self.host_lengths[row] == count).all():
            raise ValueError("a cache whose heads keep different numbers of entries cannot be cut while decoding")
        keys, values = self._key_store[row, :, :count], self._value_store[row, :, :count]
        queries = None
        if self._queries is not None:
            queries = self._queries[row, :, self._queries.shape[2] - int(self.query_counts[row]) :]
            queries = queries[:, -min(queries.shape[1], count) :]
        attended = self._attended(keys[None], values[None])[0]  # [H, count, d]: per head
        return LayerStats(
            context_len=count,
            num_kv_heads=self.heads,
            num_query_heads=query_heads,
            layer=layer,
            window_scores=last_queries_sums(queries, attended, softmax, set(needs.windows)) if needs.windows else {},
            accumulated=self._accumulated[row, :, :count] if needs.accumulated else None,
            keys=keys,
            values=values,
            recent_queries=queries if needs.queries else None,
            positions=self._positions[row, :, :count],
            end=end,
        )

    def row_recorded(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What row ``row``'s next cut would score from, as a row alone carries it into a later batch: its latest
        queries ``[Hq, c, d]`` (c ≤ W) and each entry's accumulated attention ``[Hq, n]`` (None where not recorded)."""
        queries = accumulated = None
        if self._queries is not None:
            count = int(self.query_counts[row])
            queries = self._queries[row, :, self._queries.shape[2] - count :].clone()
        if self._accumulated is not None:
            accumulated = self._accumulated[row, :, : int(self.host_lengths[row].max())].clone()
        return queries, accumulated

    def keep(self, row: int, columns: torch.Tensor) -> None:
        """Cut row ``row`` to the entries in ``columns`` ``[heads, m]`` (sorted), moved to its first m columns."""
        columns = columns.to(self._key_store.device)  # a policy may choose on another device (the host: random)
        kept = columns.shape[1]
        for store in (self._key_store, self._value_store):
            store[row, :, :kept] = store[row].gather(1, columns[:, :, None].expand(-1, -1, store.shape[-1]))
        self._positions[row, :, :kept] = self._positions[row].gather(1, columns)
        if self._accumulated is not None:
            by_query_head = columns.repeat_interleave(self._accumulated.shape[1] // self.heads, dim=0)
            self._accumulated[row, :, :kept] = self._accumulated[row].gather(1, by_query_head)
            self._accumulated[row, :, kept:] = 0.0  # the columns new tokens will take start from nothing
        self.set_row_length(row, kept)


@dataclass
class RowMemory:
    """What one row's cache held while its answer was written: the largest cache a decoding forward attended over
    (entries summed over layers and heads; stored bytes of its keys and values), and the entries at the start, before
    and after each cut and at the end, as [tokens so far, entries] points (``trace``)."""

    peak_entries: int = 0
    peak_bytes: int = 0
    cuts: int = 0
    trace: list[list[int]] = field(default_factory=list)

    def note(self, step: int, entries: int, stored_bytes: int, attended: bool = True) -> None:
        """A point of the trace; ``attended``: a forward attended over this cache (it counts for the peak)."""
        if attended:
            self.peak_entries = max(self.peak_entries, entries)
            self.peak_bytes = max(self.peak_bytes, stored_bytes)
        self.trace.append([step, entries])

    def compact_trace(self) -> list[list[int]]:
        """The start, at most ``TRACE_CUTS`` cuts (each a point before and after), and the end."""
        cuts = (len(self.trace) - 2) // 2
        if cuts <= TRACE_CUTS:
            return self.trace
        stride = math.ceil(cuts / TRACE_CUTS)
        chosen = [c for c in range(cuts) if c % stride == 0 or c == cuts - 1]
        middle = [point for c in chosen for point in self.trace[1 + 2 * c : 3 + 2 * c]]
        return [self.trace[0], *middle, self.trace[-1]]


class MemoryTracker:
    """One batch's cuts and cache sizes: which rows are due for a cut before the next forward, and what each row's
    cache held. ``live`` maps the batch's current rows to the requests' indices."""

    def __init__(
        self,
        cache: RaggedCache,
        schedules: list[DecodeSchedule | None],
        starts: list[DecodeStart | None],
        architecture: Architecture,
        rope: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]] | None,
    ):
        self.cache = cache
        self.schedules = schedules
        self.starts = starts
        self.architecture = architecture  # each layer's softmax, the query heads, RoPE's pairing
        self.rope = rope  # (start, count, layer) → the layer's RoPE cos, sin
        self.live = list(range(len(schedules)))
        self.memory = [RowMemory() for _ in schedules]
        self.forwarded = False  # whether a forward has read the caches yet (their states from then on count)

    def _size(self, batch_row: int) -> tuple[int, int]:
        held = [layer.held(batch_row) for layer in self.cache.layers]
        return sum(entries for entries, _ in held), sum(stored for _, stored in held)

    def note(self, batch_row: int, step: int, attended: bool = True) -> None:
        self.memory[self.live[batch_row]].note(step, *self._size(batch_row), attended)

    def start(self, fed: bool) -> None:
        """The caches before the answer's first token is written (``fed``: a forward already read them, feeding
        the question)."""
        self.forwarded = fed
        for batch_row in range(len(self.live)):
            self.note(batch_row, 0, attended=fed)

    def before_forward(self, generated: list[int], position: int) -> None:
        """Cut every row whose answer has just reached a multiple of its interval (``generated[b]`` tokens chosen,
        the last not yet written); the coming forward writes its first token at ``position``."""
        for batch_row, request in enumerate(self.live):
            schedule, step = self.schedules[request], generated[batch_row]
            if schedule is None or step == 0 or step % schedule.interval:
                continue
            self.note(batch_row, step, attended=self.forwarded)
            self.cut(batch_row, schedule, self.starts[request], position)
            self.memory[request].cuts += 1
            self.note(batch_row, step, attended=False)
        self.forwarded = self.forwarded or step_taken(generated)

    def cut(self, batch_row: int, schedule: DecodeSchedule, start: DecodeStart | None, end: int) -> None:
        needs = schedule.needs
        # Over the attention layers (a hybrid model's recurrent layers keep their states whole), in depth order.
        for index, (model_layer, target) in enumerate(zip(self.cache.attention_layers, schedule.targets(end))):
            layer = self.cache.layers[model_layer]
            if layer.host_lengths[batch_row].max() <= target:
                continue
            architecture = self.architecture
            stats = layer.row_stats(
                batch_row, index, needs, architecture.softmaxes[model_layer], end, architecture.query_heads
            )
            if needs.query_stats:  # the prompt's query statistics, rotated to the positions after the cut
                moments = start.moments[index]
                interleaved, scale = architecture.rotation.interleaved, architecture.rotation.scale(model_layer)
                rotated = {
                    (sink, future): rotate_moments(
                        *moments[sink], *self.rope(end, future, model_layer), interleaved, scale
                    )
                    for sink, future in needs.query_stats
                }
                stats = dataclasses.replace(stats, query_stats=rotated)
            layer.keep(batch_row, schedule.policy.select_while_decoding(stats, target, schedule.buffer))

    def select_rows(self, keep: list[int]) -> None:
        self.live = [self.live[i] for i in keep]

    def finish(self, batch_row: int, step: int) -> None:
        """The row's cache at its end (the last forward's; or, for a one-token answer, the one it started from)."""
        self.note(batch_row, step)


def step_taken(generated: list[int]) -> bool:
    """Whether the coming forward writes an answer token (not the question's feed)."""
    return any(generated)


def decoding_state(
    requests: list, layer: int, keys: torch.Tensor
) -> tuple[torch.Tensor | None, np.ndarray | None, torch.Tensor | None]:
    """What a ``ShrinkingLayer`` of a batch of which some rows have a schedule starts from, for ``layer`` (its padded
    keys ``[batch, heads, longest, d]``): the query rings, their counts and the sums the rows' policies need."""
    window = max((query_window(r.schedule.needs) for r in requests if r.schedule), default=0)
    accumulate = any(r.schedule and r.schedule.needs.accumulated for r in requests)
    batch, _, longest, _ = keys.shape
    queries = counts_of_queries = accumulated = None
    if window:
        query_heads = next(r.start.queries[layer].shape[0] for r in requests if r.start and r.start.queries)
        queries = keys.new_zeros((batch, query_heads, window, keys.shape[-1]), dtype=torch.float32)
        counts_of_queries = np.zeros(batch, dtype=np.int64)
        for row, request in enumerate(requests):
            if request.start and request.start.queries:
                own = request.start.queries[layer][:, -window:]
                queries[row, :, window - own.shape[1] :] = own
                counts_of_queries[row] = own.shape[1]
    if accumulate:
        query_heads = next(r.start.accumulated[layer].shape[0] for r in requests if r.start and r.start.accumulated)
        accumulated = keys.new_zeros((batch, query_heads, longest), dtype=torch.float32)
        for row, request in enumerate(requests):
            if request.start and request.start.accumulated:
                own = request.start.accumulated[layer]
                accumulated[row, :, : own.shape[1]] = own
    return queries, counts_of_queries, accumulated
