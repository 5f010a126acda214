"""Layers that keep a fixed-size state per sequence instead of per-token keys and values: a hybrid model's linear
attention (Qwen3-Next's and OLMo-hybrid's gated delta rule, Kimi's delta attention), state-space (Mamba: Jamba,
Bamba, Granite-4, Nemotron-H, Falcon-H1) and short convolution (LFM2) layers.

transformers' ``cache_utils`` keeps such a layer in a ``LinearAttentionLayer``: per state i (most layers have one), a
convolution state ``conv_states[i]`` ``[batch, channels, kernel]`` (the last inputs of a causal convolution) and a
recurrent state ``recurrent_states[i]`` (the linear attention's or the SSM's; absent for a convolution-only layer),
both the same size whatever the sequence's length. A config declares them in ``layer_types``: ``linear_attention``
and ``conv`` hold the state alone, ``hybrid`` (and ``hybrid_sliding``) the state and an attention layer's entries
side by side (Falcon-H1 runs both in one layer), ``mlp``/``moe``/``dummy`` nothing at all (Nemotron-H's MLP blocks).

pkvbench keeps the state whole: it is carried from the prefill (of the prompt, or of the context alone where the
question comes after compression) into every compressed cache of the prompt, stacked into the batch its rows decode
in, left alone by cuts while the answer is written, and counted in every cache's bytes. Only the attention layers'
entries are compressed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from pkvbench.engine.architecture import HYBRID_KINDS, NO_CACHE_KINDS, STATE_KINDS
from pkvbench.engine.cache import host_copy


@dataclass
class LayerState:
    """One layer's state of one sequence, as transformers' ``LinearAttentionLayer`` keeps it (batch axis of 1): per
    state index its convolution state and its recurrent state (either may be absent)."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]

    @classmethod
    def of(cls, layer: LinearAttentionCacheLayerMixin) -> LayerState:
        """A copy of what ``layer`` (a prefill's) holds: the prefill's tensors are shared by every cache of the
        prompt, and decoding updates its batch's states in place."""
        conv = {i: state.clone() for i, state in layer.conv_states.items() if layer.is_conv_states_initialized[i]}
        recurrent = {
            i: state.clone() for i, state in layer.recurrent_states.items() if layer.is_recurrent_states_initialized[i]
        }
        return cls(conv, recurrent)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    @property
    def nbytes(self) -> int:
        """The bytes it holds, in the dtypes the model keeps it (an SSM's state may be wider than the model)."""
        return sum(t.nbytes for t in self.tensors)


def state_bytes(states: dict[int, LayerState]) -> int:
    """The bytes a cache's states hold."""
    return sum(state.nbytes for state in states.values())


def prefill_cache(config) -> DynamicCache:
    """The cache a hybrid model's prefill fills: per layer transformers' own class for its state (``conv``,
    ``linear_attention``, ``hybrid``), a ``DummyLayer`` where nothing is cached, and a ``DynamicLayer`` for every
    attention layer, a sliding one's included: the engine keeps a prompt's every entry (a sliding cache layer would
    drop those its window has passed)."""
    kinds, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    layers = []
    for kind, options in zip(kinds, kwargs):
        states = options.get("number_of_states", 1)
        if kind in STATE_KINDS:
            layers.append(LinearAttentionLayer(number_of_states=states))
        elif kind in HYBRID_KINDS:
            layers.append(LinearAttentionAndFullAttentionLayer(number_of_states=states))
        elif kind in NO_CACHE_KINDS:
            layers.append(DummyLayer())
        else:
            layers.append(DynamicLayer())
    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = layers, None
    return cache


def load_states(layer: LinearAttentionLayer, states: list[LayerState], position: int) -> None:
    """Fill an empty ``layer`` with ``states`` stacked along the batch axis (copies: the model updates them in place),
    as after a prefill of ``position`` tokens."""
    first = states[0]
    for index in sorted({*first.conv, *first.recurrent}):
        if index in first.conv:
            conv = torch.cat([s.conv[index] for s in states])
            layer.lazy_initialization(conv_states=conv, state_idx=index)
            layer.conv_states[index].copy_(conv)
        if index in first.recurrent:
            recurrent = torch.cat([s.recurrent[index] for s in states])
            layer.lazy_initialization(recurrent_states=recurrent, state_idx=index)
            layer.recurrent_states[index].copy_(recurrent)
        layer.has_previous_state[index] = True
    layer.cumulative_length_linear.fill_(position)


def filled_cache(config, attention_layers, keys, values, states: dict[int, LayerState], position: int):
    """A cache as a prefill of ``position`` tokens leaves it: each attention layer's ``keys``/``values`` (``[batch,
    heads, n, d]``, in the order of ``attention_layers``; copies) and each state layer's ``states`` (a hybrid
    model's, ``prefill_cache``; an attention-only model's is a plain ``DynamicCache``)."""
    cache = prefill_cache(config) if states else DynamicCache()
    for index, (k, v) in zip(attention_layers, zip(keys, values)):
        cache.update(k.clone(), v.clone(), index)
    for index, state in states.items():
        load_states(cache.layers[index], [state], position)
    return cache


def states_of(cache) -> dict[int, LayerState]:
    """The states a prefill's ``cache`` holds, by model layer."""
    return {
        index: LayerState.of(layer)
        for index, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


class StateLayer(LinearAttentionLayer):
    """One layer's states of a batch of rows, each from its own prefill, stacked along the batch axis: the model reads
    and updates them as transformers' ``LinearAttentionLayer`` (in place), rows leave the batch by index, and a row's
    bytes are its state's."""

    def __init__(self, states: list[LayerState], position: int):
        """``states``: each row's; ``position``: the tokens before the first new one (the layer's count)."""
        super().__init__(number_of_states=max({*states[0].conv, *states[0].recurrent}, default=0) + 1)
        load_states(self, states, position)
        self.row_bytes = host_copy([s.nbytes for s in states])

    def held(self, row: int) -> tuple[int, int]:
        """No entries; the bytes of row ``row``'s state."""
        return 0, int(self.row_bytes[row])

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        """Keep only these batch rows (a device index, and the same rows on the host)."""
        for states in (self.conv_states, self.recurrent_states):
            for index, state in states.items():
                if state is not None:
                    states[index] = state[rows.to(state.device)]
        self.row_bytes = self.row_bytes[host_copy(host_rows)]

    def share_memo(self, memo: dict) -> None:
        """A state has no masks to share."""


class NoCacheLayer(DummyLayer):
    """A layer that caches nothing (Nemotron-H's MLP blocks), in a batch: no entries, no bytes, no rows to drop."""

    def held(self, row: int) -> tuple[int, int]:
        return 0, 0

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        pass

    def share_memo(self, memo: dict) -> None:
        pass


class HybridLayer(StateLayer, CacheLayerMixin):
    """A layer that keeps its rows' states and, beside them, an attention layer's entries (``hybrid`` layers:
    Falcon-H1 runs Mamba and attention side by side in each layer): the state calls are the ``StateLayer``'s, the
    attention calls (``update``, masks, lengths, cuts while decoding) its ``attention`` layer's, whatever kind that is
    (``layers.LAYER_KINDS``)."""

    def __init__(self, attention, states: list[LayerState], position: int):
        super().__init__(states, position)
        self.attention = attention

    def share_memo(self, memo: dict) -> None:
        self.attention.share_memo(memo)

    def __getattr__(self, name: str):
        if name == "attention":  # not set yet (during ``__init__``)
            raise AttributeError(name)
        return getattr(self.attention, name)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def held(self, row: int) -> tuple[int, int]:
        entries, stored = self.attention.held(row)
        return entries, stored + super().held(row)[1]

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        super().select_rows(rows, host_rows)
        self.attention.select_rows(rows, host_rows)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1
