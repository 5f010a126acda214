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

No host–device synchronisation while a batch decodes: the lengths are planned (each step adds the same number of
tokens to every row; rows leave the batch by index; cuts set a row's count), so the layer keeps a host copy
(``host_lengths``, numpy) beside the device tensor (``lengths``) and decides everything that needs a number — the
columns attention reads, whether a mask is needed, when to grow — from the host copy. A GPU then runs a whole decode
step ahead of the host; the only read back is the step's chosen tokens (``decoding.BatchDecoder``).

Every layer kind inherits ``DecodingLayer``, the contract it keeps for the decoder and the attention wrapper
(``attention._decoding_attention``); its abstract methods make a kind that forgets one fail when it is built, as
transformers' ``CacheLayerMixin`` does. Masks and index tensors depend only on the lengths, so they are built once
per step and shared by every layer whose lengths are the same (``share_memo``: the ``RaggedCache``'s memo, cleared
when a step begins at layer 0).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

# FlexAttention's block of keys: a block past a row's length is skipped, one holding its end is masked inside.
FLEX_BLOCK = 128


def host_copy(lengths: torch.Tensor | np.ndarray | Sequence) -> np.ndarray:
    """A host (numpy, int64) copy of lengths: one read back, where a batch is built, never while it decodes."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().to("cpu").numpy()
    return np.array(lengths, dtype=np.int64)


class DecodingLayer(CacheLayerMixin):
    """One layer of a batch of compressed caches, as the model (transformers' cache-layer calls: ``update``,
    ``get_seq_length``, ``get_mask_sizes``), the attention wrapper (``attention_mask``, ``observe``, ``uniform``,
    ``masked_by_lengths_alone``) and the decoder (``held``, ``select_rows``, ``lengths``) use it. None of them reads a
    tensor back to the host while a batch decodes: a kind keeps host copies of the counts it decides by
    (``RaggedLayer.host_lengths``, ``QuantizedLayer.host_quantized``)."""

    # Whether the layer's mask is ``RaggedLayer``'s (each row and head its own count, nothing else hidden): then
    # FlexAttention may replace it with a block mask built from the lengths. A kind that hides more says False.
    masked_by_lengths_alone: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "attention_mask" in vars(cls) and "masked_by_lengths_alone" not in vars(cls):
            cls.masked_by_lengths_alone = False  # a kind with a mask of its own hides more, unless it says otherwise

    @property
    @abstractmethod
    def lengths(self) -> torch.Tensor:
        """``[batch, heads]``: each row's and head's entries."""

    @abstractmethod
    def attention_mask(self) -> torch.Tensor | None:
        """``[batch, 1 or heads, new, columns]``, True where the last update's queries may look; None: everywhere."""

    @abstractmethod
    def held(self, row: int) -> tuple[int, int]:
        """Row ``row``'s entries (over heads) and the bytes of its keys and values, as a row alone stores them."""

    @abstractmethod
    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int]) -> None:
        """Keep only these batch rows: a device index and, to stay without a sync, the same rows on the host."""

    @property
    def uniform(self) -> bool:
        """Every row and head holds the same number of entries and they fill the columns attention reads: no mask at
        all, not even a causal one for one new token (the model's kernel as it is, flash on a GPU)."""
        return False

    def observe(self, query: torch.Tensor, softmax) -> None:
        """Each decoding step's queries ``[batch, Hq, new, d]`` (post-RoPE), after ``update``, with the layer's
        ``architecture.LayerSoftmax``: a kind that records for cuts while the answer is written keeps them."""

    def share_memo(self, memo: dict) -> None:
        """Build the step's masks and indices into ``memo``, shared with the batch's other layers (a kind with none
        has nothing to share)."""


class RaggedLayer(DecodingLayer, DynamicLayer):
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
        self.host_lengths = host_copy(lengths).reshape(batch, heads)
        self.lengths = torch.tensor(self.host_lengths, device=keys.device)
        self._new = 0  # tokens written by the last update (the queries of the coming attention)
        self.step_memo: dict = {}  # masks and indices of this step, shared with layers of the same lengths
        self.memo_shared = False  # True: a RaggedCache clears the memo when a step begins; else each update does
        self._expose()

    masked_by_lengths_alone = True

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: torch.Tensor) -> None:
        self._lengths = lengths

    @property
    def heads(self) -> int:
        return self._key_store.shape[1]

    @property
    def uniform(self) -> bool:
        return bool((self.host_lengths == self.host_lengths.flat[0]).all())

    def share_memo(self, memo: dict) -> None:
        self.step_memo, self.memo_shared = memo, True

    def _longest(self) -> int:
        return int(self.host_lengths.max()) if self.host_lengths.size else 0

    def _expose(self) -> None:
        longest = self._longest()
        self.keys = self._key_store[:, :, :longest]
        self.values = self._value_store[:, :, :longest]

    def _grow(self, longest: int) -> None:
        """More tokens than planned for: make room, as DynamicLayer would."""
        extra = longest - self._key_store.shape[2]
        pad = (0, 0, 0, extra)
        self._key_store = torch.nn.functional.pad(self._key_store, pad)
        self._value_store = torch.nn.functional.pad(self._value_store, pad)

    def _memo(self, kind: str, build, *extra):
        """``build()`` once per step for every layer whose lengths are these (the key holds them all)."""
        key = (kind, self.host_lengths.shape, self.host_lengths.tobytes(), self._new, *extra)
        if key not in self.step_memo:
            self.step_memo[key] = build()
        return self.step_memo[key]

    def _columns(self, new: int) -> torch.Tensor:
        """``[batch, heads, new]``: where each row and head writes its new tokens (right after its entries)."""
        return self.lengths[:, :, None] + torch.arange(new, device=self.lengths.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.memo_shared:
            self.step_memo.clear()
        if self.group > 1:  # one set per query head: every query head of a group gets the new entry
            key_states = key_states.repeat_interleave(self.group, dim=1)
            value_states = value_states.repeat_interleave(self.group, dim=1)
        new = key_states.shape[2]
        if self._longest() + new > self._key_store.shape[2]:
            self._grow(self._longest() + new)
        if self.uniform:  # one slice for the whole batch, no index
            start = int(self.host_lengths.flat[0])
            self._key_store[:, :, start : start + new] = key_states
            self._value_store[:, :, start : start + new] = value_states
        else:
            self._new = new  # the memo's key: the columns of these lengths for this many tokens
            columns = self._memo("columns", lambda: self._columns(new))[..., None]
            self._key_store.scatter_(2, columns.expand(-1, -1, -1, key_states.shape[-1]), key_states)
            self._value_store.scatter_(2, columns.expand(-1, -1, -1, value_states.shape[-1]), value_states)
        self.lengths += new
        self.host_lengths += new
        self._new = new
        self._expose()
        return self.keys, self.values

    def attention_mask(self) -> torch.Tensor | None:
        """Which stored columns each of the last update's queries may see: ``[batch, 1 or heads, new, columns]``,
        or None when every row and head sees all columns (one query, no padding)."""
        if self._new == 1 and self.uniform:
            return None
        return self._memo("mask", self._build_mask, self.keys.shape[2])

    def _build_mask(self) -> torch.Tensor:
        per_head = not bool((self.host_lengths == self.host_lengths[:, :1]).all())
        lengths = self.lengths if per_head else self.lengths[:, :1]  # the same for every head: one mask row
        visible = lengths - self._new  # entries each row and head had before the new tokens
        query = torch.arange(self._new, device=visible.device)
        limit = visible[:, :, None] + query + 1  # query i sees the row's entries and the new tokens up to itself
        return torch.arange(self.keys.shape[2], device=visible.device) < limit[..., None]

    def block_mask(self, query_heads: int):
        """FlexAttention's ``BlockMask`` over the whole store (its shape fixed while the batch lasts, so a compiled
        kernel is reused): per row and query head, the blocks of ``FLEX_BLOCK`` columns wholly before its entries'
        end (no mask inside), the one holding it (masked), none past it; the last update's queries causal among
        themselves. Built from the device lengths, no read back."""
        capacity = self._key_store.shape[2]
        return self._memo("block", lambda: self._build_block_mask(query_heads), query_heads, capacity)

    def _build_block_mask(self, query_heads: int):
        from torch.nn.attention.flex_attention import BlockMask

        new, columns = self._new, self._key_store.shape[2]
        lengths = self.lengths.repeat_interleave(query_heads // self.heads, dim=1)  # [batch, query heads]
        blocks = -(-columns // FLEX_BLOCK)
        before = lengths - new  # what every new token sees
        full = torch.div(before + 1, FLEX_BLOCK, rounding_mode="floor").to(torch.int32)  # blocks no query masks
        touched = torch.div(lengths + FLEX_BLOCK - 1, FLEX_BLOCK, rounding_mode="floor").to(torch.int32)
        order = torch.arange(blocks, device=lengths.device, dtype=torch.int32)
        full_indices = order.expand(*lengths.shape, 1, blocks).contiguous()
        partial_indices = (full[..., None, None] + order).clamp(max=blocks - 1).to(torch.int32).contiguous()
        ends = before.clone()  # captured by the mask function (a snapshot: the layer's lengths grow in place)

        def visible(batch, head, query, column):
            return column <= ends[batch, head] + query

        return BlockMask.from_kv_blocks(
            (touched - full)[..., None].contiguous(),
            partial_indices,
            full[..., None].contiguous(),
            full_indices,
            BLOCK_SIZE=FLEX_BLOCK,
            mask_mod=visible,
            seq_lengths=(new, columns),
        )

    @property
    def stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value stores, room included (what ``block_mask`` masks)."""
        return self._key_store, self._value_store

    def held(self, row: int) -> tuple[int, int]:
        """Row ``row``'s entries (summed over heads) and the bytes of its keys and values, each head padded to the
        row's fullest as a row alone would store them."""
        lengths = self.host_lengths[row]
        width = self._key_store.shape[-1] + self._value_store.shape[-1]
        return int(lengths.sum()), len(lengths) * int(lengths.max()) * width * self._key_store.element_size()

    def row_entries(self, row: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Row ``row``'s keys and values ``[heads, n, dim]`` as a row alone holds them (n its fullest head's entries,
        a head with fewer padded after its own) and each head's count: a conversation's cache carried to its next
        turn (``engine/turns.py``). Copies, so that the batch's store can go."""
        lengths = self.host_lengths[row].copy()
        stored = int(lengths.max()) if lengths.size else 0
        return self._key_store[row, :, :stored].clone(), self._value_store[row, :, :stored].clone(), lengths

    def set_row_length(self, row: int, count: int) -> None:
        """Row ``row`` now holds ``count`` entries in every head (a cut while decoding)."""
        self.lengths[row] = count
        self.host_lengths[row] = count
        self._expose()

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch); ``host_rows``: the same on the host."""
        self._key_store = self._key_store[rows]
        self._value_store = self._value_store[rows]
        self.lengths = self.lengths[rows]
        self.host_lengths = self.host_lengths[host_copy(host_rows)]
        self._expose()

    def get_seq_length(self) -> int:
        return self._longest()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._longest(), 0


def device_rows(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """An index of batch rows on ``device`` without waiting for it: through pinned memory on a GPU."""
    index = torch.tensor(list(rows), dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


class RaggedCache(Cache):
    """A batch of compressed caches, one ``DecodingLayer`` per attention layer of the model (``attention_layers``:
    which; every layer by default) and, for a hybrid model's other layers, their states or nothing
    (``recurrent.StateLayer``, ``recurrent.NoCacheLayer``: they too share memos, leave by rows and tell their bytes)."""

    layers: list[DecodingLayer]

    def __init__(self, layers: list, softmaxes: list, attention_layers: Sequence[int] | None = None, start: int = 0):
        """``softmaxes``: each layer's ``architecture.LayerSoftmax`` (what a kind that records while decoding, and
        FlexAttention, compute with); ``start``: the position of the first new token (every row's: the rows of a
        batch write the same tokens at each step)."""
        super().__init__(layers=layers)
        self.softmaxes = softmaxes
        self.attention_layers = list(range(len(layers)) if attention_layers is None else attention_layers)
        self.step_memo: dict = {}
        self.seen = [start] * len(layers)  # per layer: the tokens the sequence has had (the next one's position)
        for layer in layers:
            layer.share_memo(self.step_memo)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == self.attention_layers[0]:  # a new step: the last one's masks are stale
            self.step_memo.clear()
        self.seen[layer_idx] += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens the sequence has had, as transformers' own cache layers count them (a sliding layer's
        ``cumulative_length``), not the entries a compressed cache holds: Llama 4 scales its NoPE layers' queries by
        the position this gives (``attn_temperature_tuning``). A layer that keeps a state counts its own."""
        if layer_idx not in self.attention_layers:
            return super().get_seq_length(layer_idx)
        return self.seen[layer_idx]

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these batch rows (host row numbers: no read back), each layer by an index on its own device
        (a model placed over several devices keeps each layer's cache where the layer runs)."""
        index: dict[torch.device, torch.Tensor] = {}
        first = self.layers[self.attention_layers[0]]
        for layer in self.layers:
            device = getattr(layer, "lengths", first.lengths).device  # a state layer's rows: by the first's index
            if device not in index:
                index[device] = device_rows(rows, device)
            layer.select_rows(index[device], host_rows=rows)
