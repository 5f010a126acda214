"""Decoding layers whose entries know their original positions, and the sliding window applied while decoding.

A sliding-window layer (Mistral-7B-v0.1's every layer, Qwen2's upper layers, Gemma's local ones) lets the token at
position p see the entries at positions p − window + 1 … p only (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``). A prompt that fits the window is prefilled exactly as without one, but once the
answer takes the sequence past the window its oldest entries must drop out of sight: a compressed cache keeps
entries at their original positions, so the mask hides every entry whose position is at or below p − window, on
every row of a batch, the full cache's included.

A chunked layer (Llama 4's ``chunked_attention``) lets the token at position p see its chunk only, positions
p − p mod chunk … p (transformers' ``chunked_overlay``): the same mask with another oldest position (``oldest_seen``).
"""

from __future__ import annotations

import torch

from pkvbench.engine.cache import RaggedLayer


def oldest_seen(queries, window: int, chunked: bool = False):
    """The oldest position the tokens at positions ``queries`` (ints or a tensor) see: p − window + 1 in a sliding
    window, the start of p's chunk, p − p mod window, in a chunked layer."""
    return queries - queries % window if chunked else queries - window + 1


def row_positions(kept_positions: list[torch.Tensor | None], heads: int, longest: int, device) -> torch.Tensor:
    """A batch's entry positions ``[batch, heads, longest]`` from each row's own (``[heads, n]``, or None for
    0 … n−1); padding columns get their index (they are masked by the row's length)."""
    positions = torch.arange(longest, device=device).expand(len(kept_positions), heads, longest).clone()
    for row, kept in enumerate(kept_positions):
        if kept is not None:
            positions[row, :, : kept.shape[1]] = kept
    return positions


class PositionedLayer(RaggedLayer):
    """A ``RaggedLayer`` that knows each entry's original position. New tokens take ``next_position`` onwards; every
    row of a batch writes the same number of tokens at each step, so one counter serves the batch."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        room: int,
        kv_heads: int,
        positions: torch.Tensor,
        start: int = 0,
    ):
        """``positions`` ``[batch, heads, n]`` of the entries; ``start``: the position of the first new token."""
        super().__init__(keys, values, lengths, room, kv_heads)
        capacity = self._key_store.shape[2]
        self._positions = positions.new_zeros((*positions.shape[:2], capacity))
        self._positions[:, :, : positions.shape[2]] = positions
        self.next_position = start  # where the coming update's first token sits
        self.query_start = start  # the position of the last update's first token (its first query)

    def _grow(self, longest: int) -> None:
        super()._grow(longest)
        self._positions = torch.nn.functional.pad(
            self._positions, (0, self._key_store.shape[2] - self._positions.shape[2])
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[2]
        columns = self.lengths[:, :, None] + torch.arange(new, device=self.lengths.device)
        out = super().update(key_states, value_states, *args, **kwargs)
        positions = self.next_position + torch.arange(new, device=columns.device)
        self._positions.scatter_(2, columns, positions.expand_as(columns).contiguous())
        self.query_start = self.next_position
        self.next_position += new
        return out

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        super().select_rows(rows, host_rows)
        self._positions = self._positions[rows]

    def row_positions(self, row: int) -> torch.Tensor:
        """Row ``row``'s entries' original positions ``[heads, n]`` (as ``row_entries`` holds them)."""
        return self._positions[row, :, : int(self.host_lengths[row].max())].clone()

    @property
    def positions(self) -> torch.Tensor:
        """The exposed columns' positions ``[batch, heads, columns]``."""
        return self._positions[:, :, : self.keys.shape[2]]


class WindowMask:
    """Mixin for a ``PositionedLayer`` kind: its attention mask also hides the entries older than ``window`` (or,
    ``chunked``, than the query's chunk)."""

    window: int
    chunked = False
    masked_by_lengths_alone = False  # the window hides more than the lengths do

    def attention_mask(self) -> torch.Tensor | None:
        mask = super().attention_mask()
        newest = self.query_start + self._new - 1
        if oldest_seen(newest, self.window, self.chunked) <= 0:  # no entry is hidden yet (no mask to build)
            return mask
        queries = self.query_start + torch.arange(self._new, device=self.lengths.device)
        oldest = oldest_seen(queries, self.window, self.chunked)
        inside = self.positions[:, :, None, :] >= oldest[:, None]  # [batch, heads, new, columns]
        return inside if mask is None else mask & inside


class SlidingLayer(WindowMask, PositionedLayer):
    """A sliding-window layer of a batch of caches: the entries older than ``window`` hidden from new queries."""

    def __init__(self, *args, window: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window


class ChunkedLayer(SlidingLayer):
    """A chunked layer of a batch of caches: the entries before each new query's chunk hidden from it."""

    chunked = True
