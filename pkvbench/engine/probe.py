"""What each layer's attention does, read by running the model's own code rather than by interpreting config keys.

A forward of two tokens in which every decoder layer runs its attention module alone (no MLP, so a model without
weights — on the ``meta`` device, before loading — runs it as well as a loaded one) while the model builds its masks
as it always does. Two hooks see it: the mask interface (``attention.install_recording_attention`` registers it)
receives the *mask function* the model built each mask from (transformers' ``masking_utils``: causal, sliding
window, bidirectional overlays…), and the attention function receives each layer's call — its module, its query and
key heads, the keyword arguments the module passes (``scaling``, ``softcap``, ``s_aux`` sinks, …) and which mask the
model handed that layer. A mask function is then read at any position: whether a query sees later tokens (not
causal), and how far back it sees (its window).

RoPE's switches are read from the model's rotary embedding the same way: the rotation of a position in a forward of
L tokens, for L up to 2²², tells whether and where the tables change with the sequence's length (Phi-3's
``longrope``: short factors up to ``original_max_position_embeddings`` tokens, long ones past it).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The furthest position a mask function or a rotary embedding is read at: beyond any context a model is run with.
FAR = 1 << 22


@dataclass(frozen=True)
class LayerCall:
    """One layer's attention call, as the model makes it."""

    layer: int
    query_heads: int
    kv_heads: int
    head_dim: int
    is_causal: bool  # the module's own flag (what sdpa applies where no mask is given)
    kwargs: dict  # the keyword arguments the module passes its attention function
    mask: Callable | None  # the function the model built the layer's mask from; None: it gave no mask


@dataclass
class Probe:
    """Collects the calls of one probing forward (``_ACTIVE_PROBE``)."""

    masks: dict[int, tuple[torch.Tensor, Callable]] = field(default_factory=dict)  # id(marker) → (marker, function)
    calls: dict[int, LayerCall] = field(default_factory=dict)

    def mask(self, mask_function: Callable, device) -> torch.Tensor:
        """A marker the model hands on to the layers this mask is for (kept alive: its id is the key)."""
        import torch

        marker = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        self.masks[id(marker)] = (marker, mask_function)
        return marker

    def attention(self, module, query, key, value, attention_mask, **kwargs):

        mask = self.masks.get(id(attention_mask)) if attention_mask is not None else None
        self.calls[module.layer_idx] = LayerCall(
            layer=module.layer_idx,
            query_heads=query.shape[1],
            kv_heads=key.shape[1],
            head_dim=query.shape[-1],
            is_causal=bool(getattr(module, "is_causal", True)),
            kwargs=dict(kwargs),
            mask=None if mask is None else mask[1],
        )
        # [batch, new, Hq, d], as the kernels return (d the values' size: an MLA module's differs from its queries')
        return query.new_zeros((*query.shape[:-1], value.shape[-1])).transpose(1, 2), None


@dataclass(frozen=True)
class LayerSoftmax:
    """How a layer turns q·k into attention weights, as the statistics must too: the logits scaled by ``scaling``,
    soft-capped to softcap·tanh(logits / softcap) where ``softcap`` (Gemma 2), and each head's ``sinks`` logit ``[Hq]``
    joining the denominator where the module has them (gpt-oss; ``attention.attention_softmax``)."""

    scaling: float
    softcap: float | None = None
    sinks: object = None  # a tensor [Hq] or None


_ACTIVE_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("pkvbench_probe", default=None)


def active_probe() -> Probe | None:
    return _ACTIVE_PROBE.get()


@contextlib.contextmanager
def _attention_only(model, modules: dict) -> Iterator[None]:
    """Every decoder layer runs its attention module (``modules``: by layer) alone, with what the model hands the
    layer; a layer without one (a hybrid's recurrent layers) passes its input on."""
    layers = list(model.model.layers)
    # A layer returns its hidden states, or a tuple of them and its attention weights where the model takes them so
    # (Bamba, Falcon-H1: ``layer_outputs[0]``, ``hidden_states, attn_weights = decoder_layer(...)``).
    source = inspect.getsource(type(model.model).forward)
    tupled = re.search(r"(layer_outputs|hidden_states, \w+) = decoder_layer\(", source) is not None

    def attention_only(module):

        def forward(hidden_states, *args, **kwargs):
            if module is not None:
                module(hidden_states=hidden_states, **kwargs)
            return (hidden_states, None) if tupled else hidden_states

        return forward

    # Where accelerate placed the model (``--device-map``), its hook wraps a layer's forward and calls the layer's own
    # as ``_old_forward``: the probe takes that one's place, so the hook still moves the inputs to the layer's device,
    # and each layer gets back exactly what it had.
    slots = [(layer, "_old_forward" if hasattr(layer, "_hf_hook") else "forward") for layer in layers]
    saved = [layer.__dict__.get(slot) for layer, slot in slots]
    for index, (layer, slot) in enumerate(slots):
        setattr(layer, slot, attention_only(modules.get(index)))
    try:
        yield
    finally:
        for (layer, slot), own in zip(slots, saved):
            if own is None:
                delattr(layer, slot)
            else:
                setattr(layer, slot, own)


def layer_calls(model, modules: dict) -> tuple[dict[int, LayerCall], object]:
    """Each attention layer's call in a forward of two tokens (``model`` on the recording wrapper,
    ``attention.install_recording_attention``; on any device, ``meta`` included; ``modules``: the attention module of
    each layer that has one), and the model's own cache (``DynamicCache`` built from its config) after it: what each
    attention layer writes there, the shapes of its cache."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    forward_params = inspect.signature(model.model.forward).parameters
    cache_arg = "cache" if "cache" in forward_params else "past_key_values"  # transformers renamed it
    probe = Probe()
    cache = DynamicCache(config=model.config)
    token = _ACTIVE_PROBE.set(probe)
    try:
        with _attention_only(model, modules), torch.inference_mode():
            ids = torch.zeros((1, 2), dtype=torch.long, device=device)
            model.model(input_ids=ids, use_cache=True, **{cache_arg: cache})
    finally:
        _ACTIVE_PROBE.reset(token)
    return probe.calls, cache


@dataclass(frozen=True)
class Reach:
    """What a mask lets a query at a position see: nothing later (``causal``), and the last ``window`` positions up
    to its own (None: all of them); ``pattern`` False where the visible positions are no such run (chunks, gaps)."""

    causal: bool
    window: int | None
    pattern: bool = True


def mask_reach(mask_function: Callable | None, is_causal: bool) -> Reach:
    """Read a layer's mask function (``LayerCall.mask``) at far positions — ``FAR`` and a prime distance before it,
    so that a chunked mask shows its chunks: whether the query sees the next position, where the run of positions
    it sees up to its own begins (found by halving, then checked densely near the query and at spaced positions
    back to the start). No function: the kernel's own causal flag, no window."""
    import torch

    if mask_function is None:
        return Reach(causal=is_causal, window=None)

    def seen(query: int, columns: torch.Tensor) -> torch.Tensor:
        out = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(query), columns)
        return torch.as_tensor(out).expand(columns.shape).bool()

    reaches, causal = set(), True
    for query in (FAR, FAR - 104_729):
        causal = causal and not bool(seen(query, torch.tensor([query + 1]))[0])
        if not bool(seen(query, torch.tensor([query]))[0]):
            reaches.add((0, True))  # it does not even see itself
            continue
        before, first = -1, query  # the first position seen: after ``before``, at most ``first``
        while first - before > 1:
            middle = (before + first) // 2
            if bool(seen(query, torch.tensor([middle]))[0]):
                first = middle
            else:
                before = middle
        near = torch.arange(max(0, query - 8192), query + 1)
        spaced = torch.unique(torch.cat([near, (query * torch.linspace(0, 1, 4097)).long(), torch.tensor([first])]))
        contiguous = bool(torch.equal(seen(query, spaced), spaced >= first))
        reaches.add((None if first == 0 else query - first + 1, contiguous))
    if len(reaches) != 1:
        return Reach(causal=causal, window=None, pattern=False)
    (window, contiguous), *_ = reaches
    return Reach(causal=causal, window=window, pattern=contiguous)


def cache_windows(config, layers) -> dict[int, int | None]:
    """For each of ``layers`` (attention layers), the window the model's own cache keeps while it generates
    (transformers' ``DynamicCache`` built from ``config``, as ``generate`` builds it): a sliding cache layer keeps the
    last window − 1 entries, so a new token sees the last window positions whatever the mask says; None where it keeps
    them all. Read by writing ``FAR`` tokens (on the ``meta`` device: shapes only) into each layer."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    states = torch.empty((1, 1, FAR, 1), device="meta")
    windows = {}
    for layer in layers:
        cache.update(states, states, layer)
        kept = cache.layers[layer].keys.shape[-2]
        windows[layer] = None if kept >= FAR else kept + 1
    return windows


def rope_switch(rotary_type: type, config, layer_types: tuple[str, ...]) -> int | None:
    """The longest sequence whose RoPE tables are those of short sequences, where the tables switch once with the
    sequence's length and stay switched (Phi-3's ``longrope``: ``original_max_position_embeddings``); None where they
    never change, or keep changing as the sequence grows (dynamic NTK: the model's own decoding keeps each key's
    first rotation then, as pkvbench does). Read from fresh rotary modules (``rotary_type(config)``): a module keeps
    state between forwards."""
    import torch

    kinds = sorted(set(layer_types)) if "layer_type" in inspect.signature(rotary_type.forward).parameters else [None]

    def turn(length: int) -> list[torch.Tensor]:
        """Position 1's cos in a forward whose furthest position is length − 1, per layer kind."""
        positions = torch.tensor([[1, length - 1]])
        out = []
        for kind in kinds:
            rotary = rotary_type(config)
            extra = {} if kind is None else {"layer_type": kind}
            with torch.inference_mode():
                out.append(rotary(torch.zeros(1), positions, **extra)[0][0, 0].float())
        return out

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    short = turn(2)
    if same(turn(FAR), short):
        return None
    low, high = 2, FAR  # turn(low) is short's, turn(high) is not
    while high - low > 1:
        middle = (low + high) // 2
        if same(turn(middle), short):
            low = middle
        else:
            high = middle
    return low if same(turn(4 * high), turn(high)) else None
