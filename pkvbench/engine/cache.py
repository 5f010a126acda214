"""The cache a compressed prompt decodes from: one small layer class, in the style of transformers' cache_utils."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RoomForAnswerLayer(DynamicLayer):
    """A layer's kept prompt entries, stored with room for the answer's entries after them.

    ``DynamicLayer`` concatenates on every decoding step, copying the whole layer each time (O(T) per token, which
    at long contexts costs as much as the attention itself); here a step writes its entry in place. The keys and
    values handed to attention are the same numbers either way.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        batch, heads, length, dim = keys.shape
        self._key_store = keys.new_empty((batch, heads, length + room, dim))
        self._value_store = values.new_empty((batch, heads, length + room, values.shape[-1]))
        self._key_store[:, :, :length] = keys
        self._value_store[:, :, :length] = values
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_store[:, :, :length]
        self.values = self._value_store[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end > self._key_store.shape[-2]:  # more tokens than planned for: grow like DynamicLayer
            self._key_store = torch.cat([self.keys, key_states], dim=-2)
            self._value_store = torch.cat([self.values, value_states], dim=-2)
        else:
            self._key_store[:, :, self._length : end] = key_states
            self._value_store[:, :, self._length : end] = value_states
        self._set_length(end)
        return self.keys, self.values


def decoding_cache(keys: list[torch.Tensor], values: list[torch.Tensor], room: int) -> Cache:
    """A cache over per-layer (possibly differently sized) kept entries, ready for ``room`` new tokens."""
    return Cache(layers=[RoomForAnswerLayer(k, v, room) for k, v in zip(keys, values)])
