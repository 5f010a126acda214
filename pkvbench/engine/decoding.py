"""Greedy decoding of many compressed caches of one sample at once: one forward per step for the whole batch.

Every configuration of a sample (policy × budget × query mode) leaves a compressed cache; they decode together as
the rows of one batch. Per layer the caches are padded to the longest and masked (``cache.RaggedLayer``): each row,
and each head where heads keep different numbers of entries, sees exactly its own entries, in the order it would
see them alone. Positions are the original ones. Each row stops on its own (an end token, a stop string, its token
limit) and leaves the batch. A batch of one is the plain one-configuration-at-a-time path.

Which rows share a batch (``plan_batches``): rows whose caches have the same number of heads, are stored alike (the
model's dtype, or one ``kv_formats.KVFormat``: ``engine/quantized.py``) and feed the same tokens first (query-agnostic
rows feed their question on top of the compressed context), at most ``max_rows`` rows, and no more padding than one full cache of the prompt or ``PADDING_ALLOWANCE`` times what the rows keep themselves,
whichever is more. So a full-cache row never pads a batch of small caches to its length, while a grid's budgets
(64 to 512 entries of a 2000-token prompt) share one or two batches: on 2 CPU cores a decode step of 12 rows costs
2.6 times one of 1 (``scripts/profile_decode.py``, ``docs/benchmark.md``), so splitting a grid by budget, as the
first rule (padding at most half the kept entries) did, cost more steps than its padding saved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pkvbench.engine import shrinking
from pkvbench.engine.architecture import Architecture
from pkvbench.engine.attention import decoding
from pkvbench.engine.cache import RaggedCache, device_rows
from pkvbench.engine.layers import build_cache
from pkvbench.engine.quantized import StoredEntries
from pkvbench.engine.recurrent import LayerState, state_bytes

# A batch may pad by this fraction of the entries its rows keep, or by one full cache of the prompt if more.
PADDING_ALLOWANCE = 0.5


@dataclass
class KeptEntries:
    """One row's compressed cache: per attention layer ``[heads, n, dim]`` keys and values; where heads keep
    different numbers of entries, ``lengths[layer]`` says how many (``[heads]``; the rest of ``n`` is padding); a
    hybrid model's recurrent layers' states, kept whole (by model layer, ``recurrent.LayerState``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[torch.Tensor] | None = None
    positions: list[torch.Tensor] | None = None  # [heads, n] each entry's original position (None: 0 … n−1)
    states: dict[int, LayerState] = field(default_factory=dict)
    storage: ClassVar[str] = "ragged"  # how a batch of them decodes (layers.LAYER_KINDS)

    def stored(self, layer: int) -> int:
        return self.keys[layer].shape[1]

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(k.shape[0] for k in self.keys)

    @property
    def nbytes(self) -> int:
        """Physical bytes of the keys and values (padding included) and of the states."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values)) + state_bytes(self.states)

    @property
    def entries(self) -> int:
        """Entries kept, over layers and heads (padding not counted)."""
        if self.lengths is None:
            return sum(k.shape[0] * k.shape[1] for k in self.keys)
        return int(sum(int(n.sum()) for n in self.lengths))


@dataclass
class DecodeRequest:
    """Decode from ``kept`` at original positions starting at ``position``: first run ``feed`` through the model (if
    any), then generate greedily from ``first_logits`` (when nothing is fed) or from the feed's last logits."""

    kept: KeptEntries | StoredEntries  # the latter: stored in fewer bits (engine/quantized.py)
    position: int
    max_new_tokens: int
    first_logits: torch.Tensor | None = None
    feed: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0
    schedule: shrinking.DecodeSchedule | None = None  # cut the cache while the answer is written
    start: shrinking.DecodeStart | None = None  # what the schedule's cuts start from


@dataclass
class Decoded:
    tokens: list[int]
    text: str
    seconds: float  # from the start of its batch to this row's last token
    batch: int = 1  # rows that decoded together
    hit_limit: bool = False  # stopped at max_new_tokens, not by an end token or a stop string
    memory: shrinking.RowMemory = field(default_factory=shrinking.RowMemory)  # what its cache held while decoding


@dataclass
class _Row:
    request: DecodeRequest
    index: int
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Batch:
    """One batch while it decodes: its rows, cache and cut tracker, the position its answers start at, when it
    started, the rows still writing and the tokens each may not choose yet (``BatchDecoder._barred_rows``)."""

    rows: list[_Row]
    cache: RaggedCache
    tracker: shrinking.MemoryTracker
    position: int
    started: float
    live: list[_Row]
    barred: torch.Tensor | None = None


def plan_batches(requests: list[DecodeRequest], max_rows: int | None) -> list[list[int]]:
    """Indices of ``requests`` grouped into batches (see the module docstring)."""
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        stored_as = getattr(request.kept, "format", None)  # rows of one batch share how their caches are stored
        groups.setdefault((request.kept.heads, stored_as, request.feed, request.position), []).append(index)
    batches = []
    for members in groups.values():
        members.sort(key=lambda i: requests[i].kept.entries)
        batch: list[int] = []
        for index in members:
            candidate = [*batch, index]
            if batch and ((max_rows and len(candidate) > max_rows) or _too_padded(requests, candidate)):
                batches.append(batch)
                candidate = [index]
            batch = candidate
        batches.append(batch)
    return batches


def _too_padded(requests: list[DecodeRequest], batch: list[int]) -> bool:
    """Whether the batch's padding exceeds both one full cache of the prompt and the allowance on what it keeps."""
    kept = [requests[i].kept for i in batch]
    heads = kept[0].heads
    stored = sum(len(kept) * heads[layer] * max(k.stored(layer) for k in kept) for layer in range(len(heads)))
    entries = sum(k.entries for k in kept)
    full_cache = sum(heads) * requests[batch[0]].position
    return stored - entries > max(PADDING_ALLOWANCE * entries, full_cache)


class BatchDecoder:
    """Decodes batches of requests through ``forward(input_ids, cache, position_ids) -> last logits [batch, vocab]``."""

    def __init__(
        self,
        forward: Callable,
        tokenizer,
        stop_ids: set[int],
        device: torch.device,
        sync: Callable[[], None],
        architecture: Architecture,
        rope: Callable | None = None,
    ):
        self.forward = forward
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.device = device
        self.sync = sync
        self.architecture = architecture  # the layers' kinds, windows and softmaxes, the heads, RoPE's pairing
        self.rope = rope  # RoPE's cos, sin of positions (start, count) of a layer: Expected Attention's cuts
        # Entered around every decode step after the first (its choice, row selection and forward): a check that
        # a step never waits for the device (``scripts/bench_gpu.py``: ``torch.cuda.set_sync_debug_mode``).
        self.step_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def decode(self, requests: list[DecodeRequest], max_rows: int | None = None) -> list[Decoded]:
        results: list[Decoded | None] = [None] * len(requests)
        for batch in plan_batches(requests, max_rows):
            for index, decoded in zip(batch, self.decode_batch([requests[i] for i in batch])):
                results[index] = decoded
        return results

    def cache_for(self, requests: list[DecodeRequest], room: int) -> RaggedCache:
        """Per layer the class of its attention kind and the rows' storage (``layers.LAYER_KINDS``)."""
        return build_cache(requests, room, self.architecture)

    @staticmethod
    def _room(requests: list[DecodeRequest]) -> int:
        """New columns to allocate: the feed and the answer; a row cut while decoding needs only its interval
        beyond its target (``DecodeSchedule.room``)."""
        if not any(r.schedule for r in requests):
            return len(requests[0].feed) + max(r.max_new_tokens for r in requests)
        longest = max(r.kept.stored(0) for r in requests)
        answers = [
            min(r.max_new_tokens, r.schedule.room(longest)) if r.schedule else r.max_new_tokens for r in requests
        ]
        return len(requests[0].feed) + max(answers)

    @torch.inference_mode()
    def decode_batch(self, requests: list[DecodeRequest]) -> list[Decoded]:
        """Decode requests that share their heads, feed and position, as one batch.

        One read back per step, the chosen tokens: the choice (barred tokens masked while a row is short of its
        minimum) runs on the device for the whole batch, the next step's input is the chosen tokens' tensor itself,
        and the cache decides from its host copy of the lengths (``cache.RaggedLayer``). Every step after the first
        runs inside ``step_guard()`` (``scripts/bench_gpu.py`` makes a sync there an error)."""
        batch = self._start(requests)
        with decoding(batch.cache):
            logits = self._first_logits(batch)
            guard = contextlib.nullcontext
            while True:
                with guard():
                    chosen = greedy_rows(logits, batch.barred)
                self._take(batch, chosen.tolist())  # the step's one read back
                chosen = self._retire_finished(batch, chosen, guard)
                if not batch.live:
                    break
                logits = self._forward_step(batch, chosen, guard)
                guard = self.step_guard  # the first forward may compile kernels and read back; no later one
        self.sync()
        return [self._decoded(batch, row) for row in batch.rows]

    def _start(self, requests: list[DecodeRequest]) -> _Batch:
        """The batch's cache (room for its feed and answers), the tracker of its cuts and sizes, its rows."""
        cache = self.cache_for(requests, room=self._room(requests))
        schedules, starts = [r.schedule for r in requests], [r.start for r in requests]
        tracker = shrinking.MemoryTracker(cache, schedules, starts, self.architecture, self.rope)
        rows = [_Row(request, index) for index, request in enumerate(requests)]
        return _Batch(rows, cache, tracker, requests[0].position, time.perf_counter(), rows)

    def _first_logits(self, batch: _Batch) -> torch.Tensor:
        """The logits the first token is chosen from: the feed's last (the question fed on top of the compressed
        context, at its original positions), else the prefill's; the tokens barred before each row's minimum."""
        requests = [row.request for row in batch.rows]
        feed = requests[0].feed
        if feed:
            ids = torch.tensor([feed] * len(requests), device=self.device)
            positions = torch.arange(batch.position, batch.position + len(feed), device=self.device)
            batch.tracker.before_forward([0] * len(requests), batch.position)  # no token chosen: the position only
            logits = self.forward(ids, batch.cache, positions.expand(len(requests), -1))
            batch.position += len(feed)
        else:
            logits = torch.stack([r.first_logits for r in requests])
        batch.tracker.start(fed=bool(feed))
        batch.barred = self._barred_rows(requests, logits.shape[-1])
        return logits

    @staticmethod
    def _take(batch: _Batch, tokens: list[int]) -> None:
        """Each live row's chosen token; rows past their minimum may choose any token from then on."""
        for row, token in zip(batch.live, tokens):
            row.tokens.append(token)
        if batch.barred is None:
            return
        for batch_row, row in enumerate(batch.live):
            if len(row.tokens) == row.request.min_new_tokens:
                batch.barred[batch_row] = False
        if not any(len(r.tokens) < r.request.min_new_tokens for r in batch.live):
            batch.barred = None

    def _retire_finished(self, batch: _Batch, chosen: torch.Tensor, guard) -> torch.Tensor:
        """Rows that stopped (an end token, a stop string, their limit) leave the batch, its cache and its bars;
        the chosen tokens of the rows that stay."""
        finished = [self._finished(row) for row in batch.live]
        if not any(finished):
            return chosen
        now = time.perf_counter()
        for batch_row, (row, done) in enumerate(zip(batch.live, finished)):
            if done:
                row.seconds = now - batch.started
                batch.tracker.finish(batch_row, len(row.tokens))
        keep = [i for i, done in enumerate(finished) if not done]
        batch.live = [batch.live[i] for i in keep]
        if not keep:
            return chosen
        with guard():
            index = device_rows(keep, self.device)
            batch.cache.select_rows(keep)
            chosen = chosen[index]
            batch.barred = None if batch.barred is None else batch.barred[index]
        batch.tracker.select_rows(keep)
        return chosen

    def _forward_step(self, batch: _Batch, chosen: torch.Tensor, guard) -> torch.Tensor:
        """Cut the rows due for a cut, then write the chosen tokens at their position: the next step's logits."""
        position = batch.position + len(batch.live[0].tokens) - 1
        batch.tracker.before_forward([len(row.tokens) for row in batch.live], position)
        with guard():
            steps = torch.full((len(batch.live), 1), position, device=self.device)
            return self.forward(chosen[:, None], batch.cache, steps)

    def _decoded(self, batch: _Batch, row: _Row) -> Decoded:
        return Decoded(
            tokens=row.tokens,
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
            seconds=row.seconds,
            batch=len(batch.rows),
            hit_limit=self._hit_limit(row),
            memory=batch.tracker.memory[row.index],
        )

    def _barred_rows(self, requests: list[DecodeRequest], vocab: int) -> torch.Tensor | None:
        """``[batch, vocab]``: the tokens each row may not choose before its ``min_new_tokens`` — the end tokens and
        its stop strings' last tokens (transformers' ``min_length``, which LongBench's samsum uses so that an answer
        never starts with its stop newline); None when no row has a minimum."""
        if not any(r.min_new_tokens for r in requests):
            return None
        barred = torch.zeros((len(requests), vocab), dtype=torch.bool)
        for row, request in enumerate(requests):
            if request.min_new_tokens:
                barred[row, self.barred(request.stop_strings)] = True
        return barred.to(self.device)

    def _hit_limit(self, row: _Row) -> bool:
        """Whether the answer stopped at its token limit rather than by an end token or a stop string."""
        request = row.request
        if len(row.tokens) < request.max_new_tokens or row.tokens[-1] in self.stop_ids:
            return False
        return not (request.stop_strings and any(s in self.tokenizer.decode(row.tokens) for s in request.stop_strings))

    def barred(self, stop_strings: tuple[str, ...]) -> list[int]:
        last_tokens = {self.tokenizer.encode(s, add_special_tokens=False)[-1] for s in stop_strings}
        return sorted(self.stop_ids | last_tokens)

    def _finished(self, row: _Row) -> bool:
        request = row.request
        if len(row.tokens) >= request.max_new_tokens or row.tokens[-1] in self.stop_ids:
            return True
        return bool(request.stop_strings) and any(s in self.tokenizer.decode(row.tokens) for s in request.stop_strings)


def greedy_rows(logits: torch.Tensor, barred: torch.Tensor | None) -> torch.Tensor:
    """``[batch]``: each row's greedy token on the device, ``barred`` ``[batch, vocab]`` tokens excluded (the first
    maximum on ties, as ``greedy``)."""
    if barred is not None:
        logits = logits.masked_fill(barred, float("-inf"))
    return logits.argmax(dim=-1)


def greedy(logits: torch.Tensor, barred: list[int]) -> int:
    if barred:
        logits = logits.clone()
        logits[barred] = float("-inf")
    return int(logits.argmax())
