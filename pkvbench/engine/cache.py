"""The caches that compressed prompts decode from: one small layer class, in the style of transformers' cache_utils.

A ``RaggedLayer`` holds one layer of a *batch* of compressed caches whose rows — and, for head-wise budgets, whose
heads — keep different numbers of entries. Row r, head h keeps its entries in columns ``[0, lengths[r, h])`` of a
padded store, in their original order; each new token is written right after the row's own entries. So a row's
entries are contiguous and in the same order as they would be alone, and the padding sits at the end where it is
masked out: the numbers a row sees do not depend on what else is in the batch.

The store has room for the answer's tokens from the start (transformers' ``DynamicLayer`` concatenates on every
step, copying the whole layer each time: O(T) per token). A layer may hold one set of entries per *query* head
(the reference protocol's ``gqa=query``); it then repeats each new token's key and value to every query head of its
group, as the reference code's ``repeat_kv`` does before its cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RaggedLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, room: int, kv_heads: int):
        """``keys``/``values``: ``[batch, heads, n, dim]`` with row r, head h's entries in ``[:lengths[r, h]]``;
        ``room``: new tokens to make space for; ``kv_heads``: the heads of the keys the model hands to ``update``."""
        super().__init__()
        self.lazy_initialization(keys, values)
        batch, heads, stored, _ = keys.shape
        self.group = heads // kv_heads  # > 1: this layer keeps one set per query head
        self._key_store = keys.new_zeros((batch, heads, stored + room, keys.shape[-1]))
        self._value_store = values.new_zeros((batch, heads, stored + room, values.shape[-1]))
        self._key_store[:, :, :stored] = keys
        self._value_store[:, :, :stored] = values
        self.lengths = lengths.to(device=keys.device, dtype=torch.long).clone()
        self._new = 0  # tokens written by the last update (the queries of the coming attention)
        self._expose()

    @property
    def heads(self) -> int:
        return self._key_store.shape[1]

    def _expose(self) -> None:
        longest = int(self.lengths.max())
        self.keys = self._key_store[:, :, :longest]
        self.values = self._value_store[:, :, :longest]

    def _grow(self, longest: int) -> None:
        """More tokens than planned for: make room, as DynamicLayer would."""
        extra = longest - self._key_store.shape[2]
        pad = (0, 0, 0, extra)
        self._key_store = torch.nn.functional.pad(self._key_store, pad)
        self._value_store = torch.nn.functional.pad(self._value_store, pad)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.group > 1:  # one set per query head: every query head of a group gets the new entry
            key_states = key_states.repeat_interleave(self.group, dim=1)
            value_states = value_states.repeat_interleave(self.group, dim=1)
        new = key_states.shape[2]
        columns = self.lengths[:, :, None] + torch.arange(new, device=self.lengths.device)  # [batch, heads, new]
        if int(columns.max()) >= self._key_store.shape[2]:
            self._grow(int(columns.max()) + 1)
        self._key_store.scatter_(2, columns[..., None].expand(-1, -1, -1, key_states.shape[-1]), key_states)
        self._value_store.scatter_(2, columns[..., None].expand(-1, -1, -1, value_states.shape[-1]), value_states)
        self.lengths += new
        self._new = new
        self._expose()
        return self.keys, self.values

    def attention_mask(self) -> torch.Tensor | None:
        """Which stored columns each of the last update's queries may see: ``[batch, 1 or heads, new, columns]``,
        or None when every row and head sees all columns (one query, no padding)."""
        visible = self.lengths - self._new  # entries each row and head had before the new tokens
        if self._new == 1 and bool((self.lengths == self.keys.shape[2]).all()):
            return None
        if bool((self.lengths == self.lengths[:, :1]).all()):
            visible = visible[:, :1]  # the same for every head: one mask row serves them all
        query = torch.arange(self._new, device=visible.device)
        limit = visible[:, :, None] + query + 1  # query i sees the row's entries and the new tokens up to itself
        return torch.arange(self.keys.shape[2], device=visible.device) < limit[..., None]

    def held(self, row: int) -> tuple[int, int]:
        """Row ``row``'s entries (summed over heads) and the bytes of its keys and values, each head padded to the
        row's fullest as a row alone would store them."""
        lengths = self.lengths[row]
        width = self._key_store.shape[-1] + self._value_store.shape[-1]
        return int(lengths.sum()), len(lengths) * int(lengths.max()) * width * self._key_store.element_size()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        self._key_store = self._key_store[rows]
        self._value_store = self._value_store[rows]
        self.lengths = self.lengths[rows]
        self._expose()

    def get_seq_length(self) -> int:
        return int(self.lengths.max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.lengths.max()), 0


class RaggedCache(Cache):
    """A batch of compressed caches, one ``RaggedLayer`` per model layer."""

    def __init__(self, layers: list[RaggedLayer]):
        super().__init__(layers=layers)

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)
