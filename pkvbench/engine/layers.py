"""The layers a batch of compressed caches decodes from: one base (``cache.DecodingLayer``), one class per kind, chosen per layer
from a table keyed by the layer's attention kind and how its rows are stored — as transformers' ``cache_utils`` maps
a config's ``layer_types`` to one cache-layer class each (``DYNAMIC_LAYER_TYPE_MAPPING``).

Attention kinds (``architecture.FULL``, ``architecture.SLIDING``) come from the model's ``Architecture``; storages:

- ``ragged``: entries in the model's dtype, rows and heads of different lengths (``cache.RaggedLayer``);
- ``shrinking``: the same, cut again while the answer is written (``shrinking.ShrinkingLayer``);
- ``stored``: packed in fewer bits (``quantized.QuantizedLayer``).

A sliding layer's class is its full-attention counterpart that also knows each entry's original position and hides
the entries older than the window from new queries (``sliding.WindowMask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkvbench.engine.architecture import (
    CHUNKED,
    FULL,
    HYBRID_KINDS,
    NO_CACHE_KINDS,
    SLIDING,
    STATE_KINDS,
    Architecture,
)
from pkvbench.engine.cache import RaggedCache, RaggedLayer
from pkvbench.engine.quantized import QuantizedLayer
from pkvbench.engine.recurrent import HybridLayer, NoCacheLayer, StateLayer
from pkvbench.engine.shrinking import ShrinkingLayer, decoding_state
from pkvbench.engine.sliding import ChunkedLayer, SlidingLayer, WindowMask, oldest_seen, row_positions


class SlidingShrinkingLayer(WindowMask, ShrinkingLayer):
    """A sliding-window layer of rows cut while the answer is written."""

    def __init__(self, *args, window: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window


class ChunkedShrinkingLayer(SlidingShrinkingLayer):
    chunked = True


class SlidingQuantizedLayer(QuantizedLayer):
    """A sliding-window layer of stored caches: the packed entries and the residual's both hidden once older than
    the window (the residual and new tokens in a ``SlidingLayer``)."""

    residual_kind = SlidingLayer

    def __init__(self, rows, fmt, dtype, room: int, kv_heads: int, *, start: int, window: int):
        self.window, self._start = window, start
        super().__init__(rows, fmt, dtype, room, kv_heads)
        if self.width:
            heads = rows[0].residual_keys.shape[0]
            packed = [row.packed_positions for row in rows]
            self.packed_positions = row_positions(packed, heads, self.width, self.device)

    def _residual_layer(self, rows, keys, values, lengths, room: int, kv_heads: int) -> RaggedLayer:
        positions = row_positions([row.residual_positions for row in rows], keys.shape[1], keys.shape[2], keys.device)
        return self.residual_kind(keys, values, lengths, room, kv_heads, positions, self._start, window=self.window)

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        super().select_rows(rows, host_rows)
        if self.width:
            self.packed_positions = self.packed_positions[rows]

    def attention_mask(self) -> torch.Tensor | None:
        mask = super().attention_mask()
        residual = self.residual
        newest = residual.query_start + residual._new - 1
        chunked = self.residual_kind.chunked
        if not self.width or oldest_seen(newest, self.window, chunked) <= 0:
            return mask
        queries = residual.query_start + torch.arange(residual._new, device=self.device)
        oldest = oldest_seen(queries, self.window, chunked)
        inside = self.packed_positions[:, :, None, :] >= oldest[:, None]  # [batch, heads, new, width]
        if mask is None:
            columns = self.width + residual.keys.shape[2]
            mask = torch.ones((*inside.shape[:3], columns), dtype=torch.bool, device=self.device)
        mask = mask.expand(-1, inside.shape[1], -1, -1).clone()
        mask[..., : self.width] &= inside
        return mask


class ChunkedQuantizedLayer(SlidingQuantizedLayer):
    residual_kind = ChunkedLayer


@dataclass(frozen=True)
class LayerBatch:
    """One attention layer of a batch: the rows' requests, the layer's index among the attention layers (what the
    rows' kept entries are listed by), where new tokens start, the room to make, the model's KV heads and the layer's
    sliding window (None: full attention)."""

    requests: list
    layer: int
    start: int
    room: int
    kv_heads: int
    window: int | None
    expand: object = None  # a latent (MLA) layer's ``expand_kv`` (its cut while decoding scores per head)


def _padded(batch: LayerBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's keys and values of the layer padded to its longest row, and each row's and head's count."""
    keys = [r.kept.keys[batch.layer] for r in batch.requests]
    values = [r.kept.values[batch.layer] for r in batch.requests]
    heads, dim = keys[0].shape[0], keys[0].shape[-1]
    longest = max(k.shape[1] for k in keys)
    key_store = keys[0].new_zeros((len(keys), heads, longest, dim))
    value_store = values[0].new_zeros((len(values), heads, longest, values[0].shape[-1]))
    lengths = torch.empty((len(keys), heads), dtype=torch.long)
    for row, (k, v, request) in enumerate(zip(keys, values, batch.requests)):
        key_store[row, :, : k.shape[1]] = k
        value_store[row, :, : v.shape[1]] = v
        lengths[row] = request.kept.lengths[batch.layer] if request.kept.lengths is not None else k.shape[1]
    return key_store, value_store, lengths


def _positions(batch: LayerBatch, keys: torch.Tensor) -> torch.Tensor:
    kept = [r.kept.positions[batch.layer] if r.kept.positions is not None else None for r in batch.requests]
    return row_positions(kept, keys.shape[1], keys.shape[2], keys.device)


def _window(batch: LayerBatch) -> dict:
    return {} if batch.window is None else {"window": batch.window}


def _ragged(kind: type, batch: LayerBatch):
    keys, values, lengths = _padded(batch)
    return kind(keys, values, lengths, batch.room, batch.kv_heads)


def _positioned(kind: type, batch: LayerBatch):
    keys, values, lengths = _padded(batch)
    positions = _positions(batch, keys)
    return kind(keys, values, lengths, batch.room, batch.kv_heads, positions, batch.start, **_window(batch))


def _shrinking(kind: type, batch: LayerBatch):
    keys, values, lengths = _padded(batch)
    queries, counts, accumulated = decoding_state(batch.requests, batch.layer, keys)
    positions = _positions(batch, keys)
    return kind(
        keys,
        values,
        lengths,
        batch.room,
        batch.kv_heads,
        positions,
        queries,
        counts,
        accumulated,
        batch.start,
        expand=batch.expand,
        **_window(batch),
    )


def _stored(kind: type, batch: LayerBatch):
    first = batch.requests[0].kept
    rows = [r.kept.layers[batch.layer] for r in batch.requests]
    extra = {} if batch.window is None else {"start": batch.start, "window": batch.window}
    return kind(rows, first.format, first.dtype, batch.room, batch.kv_heads, **extra)


# (attention kind, storage) → the layer class and how a batch builds it. The one place that knows them all.
LAYER_KINDS: dict[tuple[str, str], tuple[type, object]] = {
    (FULL, "ragged"): (RaggedLayer, _ragged),
    (SLIDING, "ragged"): (SlidingLayer, _positioned),
    (FULL, "shrinking"): (ShrinkingLayer, _shrinking),
    (SLIDING, "shrinking"): (SlidingShrinkingLayer, _shrinking),
    (FULL, "stored"): (QuantizedLayer, _stored),
    (SLIDING, "stored"): (SlidingQuantizedLayer, _stored),
    (CHUNKED, "ragged"): (ChunkedLayer, _positioned),
    (CHUNKED, "shrinking"): (ChunkedShrinkingLayer, _shrinking),
    (CHUNKED, "stored"): (ChunkedQuantizedLayer, _stored),
}


def storage_of(requests: list) -> str:
    """How a batch's rows are stored: ``stored`` in fewer bits, ``shrinking`` where a row is cut while decoding,
    else ``ragged``. Rows of one batch share it (``decoding.plan_batches``)."""
    if requests[0].kept.storage == "stored":  # never cut while decoding (api.resolve)
        return "stored"
    return "shrinking" if any(r.schedule for r in requests) else "ragged"


def build_cache(requests: list, room: int, architecture: Architecture, storage: str | None = None) -> RaggedCache:
    """The batch's cache: per model layer the class its attention kind and the rows' storage name (``storage``: that
    one instead of the rows', as a conversation that records for its cuts asks for ``shrinking``); a recurrent
    layer's rows' states stacked (``recurrent.StateLayer``; beside the entries in a ``hybrid`` layer); nothing
    where the layer caches nothing."""
    storage = storage or storage_of(requests)
    start = requests[0].position
    expanders = architecture.expanders or (None,) * architecture.num_layers
    layers, attention = [], []
    for layer, kind in enumerate(architecture.layer_kinds):
        if kind in STATE_KINDS:
            layers.append(StateLayer([r.kept.states[layer] for r in requests], start))
            continue
        if kind in NO_CACHE_KINDS:
            layers.append(NoCacheLayer())
            continue
        cls, build = LAYER_KINDS[architecture.attention_kind(layer), storage]
        batch = LayerBatch(
            requests,
            len(attention),
            start,
            room,
            architecture.cache_shapes[len(attention)].heads,  # each layer's own (Gemma 4's differ)
            architecture.window(layer),
            expanders[layer],
        )
        built = build(cls, batch)
        if kind in HYBRID_KINDS:  # its state beside its entries
            built = HybridLayer(built, [r.kept.states[layer] for r in requests], start)
        layers.append(built)
        attention.append(layer)
    return RaggedCache(layers, list(architecture.softmaxes), attention, start)
