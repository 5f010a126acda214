"""What each layer's attention does, read by running the model's own code rather than by interpreting config keys.

A forward of a few tokens in which every decoder layer runs its attention module alone (no MLP, so a model without
weights — on the ``meta`` device, before loading — runs it as well as a loaded one; a hybrid's recurrent layers pass
their input on) while the model builds its masks as it always does. Two hooks see it: the mask interface (``attention.install_recording_attention`` registers it)
receives the *mask function* the model built each mask from (transformers' ``masking_utils``: causal, sliding
window, bidirectional overlays…), and the attention function receives each layer's call — its module, its query and
key heads, the keyword arguments the module passes (``scaling``, ``softcap``, ``s_aux`` sinks, …) and which mask the
model handed that layer. A mask function is then read at any position: whether a query sees later tokens (not
causal), and how far back it sees (its window).

Which layers rotate is read in the same forward: the model's rotary function (its modeling module's
``apply_rotary*``) is watched, and a layer whose attention never calls it is NoPE; what the function gave against the
queries the kernel got shows a norm applied after RoPE (Hunyuan).

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
    query: torch.Tensor | None = None  # the queries its kernel got [batch, Hq, n, d]
    rotary: RotaryCall | None = None  # its call of the model's rotary function; None: a NoPE layer


@dataclass(frozen=True)
class RotaryCall:
    """A layer's call of its model's rotary function: the function, the axis its queries' heads lie on (1, or 2 for
    Llama 4's), and the queries it gave ``[batch, heads, n, d]``; ``pair``: it takes and returns queries and keys
    together (most), else one tensor at a time (Gemma 4); ``options``: the call's other keyword arguments
    (``unsqueeze_dim``)."""

    function: Callable
    heads_axis: int
    turned: torch.Tensor
    pair: bool = True
    options: dict = field(default_factory=dict)


@dataclass
class Probe:
    """Collects the calls of one probing forward (``_ACTIVE_PROBE``)."""

    masks: dict[int, tuple[torch.Tensor, Callable]] = field(default_factory=dict)  # id(marker) → (marker, function)
    calls: dict[int, LayerCall] = field(default_factory=dict)
    rotary: dict[int, RotaryCall] = field(default_factory=dict)  # per layer, its first rotary call
    layer: int | None = None  # the layer whose attention runs

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
            query=query,
            rotary=self.rotary.get(module.layer_idx),
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
def _attention_only(model, probe: Probe, modules: dict) -> Iterator[None]:
    """Every decoder layer runs its attention module (``modules``: by layer) alone, with what the model hands the
    layer; a layer without one (a hybrid's recurrent layers) passes its input on."""
    layers = list(model.model.layers)
    # A layer returns its hidden states, or a tuple of them and its attention weights where the model takes them so
    # (Bamba, Falcon-H1: ``layer_outputs[0]``, ``hidden_states, attn_weights = decoder_layer(...)``).
    source = inspect.getsource(type(model.model).forward)
    tupled = re.search(r"(layer_outputs|hidden_states, \w+) = decoder_layer\(", source) is not None

    def attention_only(index, module):

        def forward(hidden_states, *args, **kwargs):
            if module is not None:
                probe.layer = index
                module(hidden_states=hidden_states, **kwargs)
            return (hidden_states, None) if tupled else hidden_states

        return forward

    # Where accelerate placed the model (``--device-map``), its hook wraps a layer's forward and calls the layer's own
    # as ``_old_forward``: the probe takes that one's place, so the hook still moves the inputs to the layer's device,
    # and each layer gets back exactly what it had.
    slots = [(layer, "_old_forward" if hasattr(layer, "_hf_hook") else "forward") for layer in layers]
    saved = [layer.__dict__.get(slot) for layer, slot in slots]
    for index, (layer, slot) in enumerate(slots):
        setattr(layer, slot, attention_only(index, modules.get(index)))
    try:
        yield
    finally:
        for (layer, slot), own in zip(slots, saved):
            if own is None:
                delattr(layer, slot)
            else:
                setattr(layer, slot, own)


@contextlib.contextmanager
def _watching_rotary(modules: dict, probe: Probe, heads: int) -> Iterator[None]:
    """The rotary functions of the attention modules' modeling module (``apply_rotary*``) record, per layer, their
    first call (``heads``: the query heads, to tell the axis they lie on)."""
    modeling = inspect.getmodule(type(next(iter(modules.values()), None)))
    originals = {
        name: value for name, value in vars(modeling).items() if name.startswith("apply_rotary") and callable(value)
    }

    def watched(function):
        def spy(query, *args, **kwargs):
            turned = function(query, *args, **kwargs)
            if probe.layer is not None and probe.layer not in probe.rotary:
                axis = 1 if query.shape[1] == heads else 2
                pair = isinstance(turned, tuple)
                out = turned[0] if pair else turned
                out = out if axis == 1 else out.transpose(1, 2)
                options = {key: value for key, value in kwargs.items() if isinstance(value, (int, str, bool))}
                probe.rotary[probe.layer] = RotaryCall(function, axis, out, pair, options)
            return turned

        return spy

    for name, function in originals.items():
        setattr(modeling, name, watched(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(modeling, name, function)


def layer_calls(model, modules: dict) -> tuple[dict[int, LayerCall], object]:
    """Each attention layer's call in a forward of a few tokens (``model`` on the recording wrapper,
    ``attention.install_recording_attention``; on any device, ``meta`` included; the queries' values mean something
    only on a loaded model; ``modules``: the attention module of each layer that has one), and the model's own cache
    (``DynamicCache`` built from its config) after it: what each attention layer writes there, the shapes of its
    cache. The tokens are 1, 2, …, never the padding token whose embedding may be zero, three more than the model
    has heads, so that no axis of a query is ambiguous."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    forward_params = inspect.signature(model.model.forward).parameters
    cache_arg = "cache" if "cache" in forward_params else "past_key_values"  # transformers renamed it
    heads = getattr(model.config, "num_attention_heads", 1)
    count = heads + 3
    probe = Probe()
    cache = DynamicCache(config=model.config)
    token = _ACTIVE_PROBE.set(probe)
    try:
        with _attention_only(model, probe, modules), _watching_rotary(modules, probe, heads), torch.inference_mode():
            ids = (torch.arange(1, count + 1, device=device) % model.config.vocab_size)[None]
            model.model(input_ids=ids, use_cache=True, **{cache_arg: cache})
    finally:
        _ACTIVE_PROBE.reset(token)
    return probe.calls, cache


@dataclass(frozen=True)
class Reach:
    """What a mask lets a query at a position see: nothing later (``causal``), and the last ``window`` positions up
    to its own (None: all of them), or, ``chunk``, the positions of its chunk up to its own (p − p mod chunk … p,
    transformers' ``chunked_overlay``: Llama 4); ``pattern`` False where the visible positions are none of these."""

    causal: bool
    window: int | None
    pattern: bool = True
    chunk: int | None = None


def mask_reach(mask_function: Callable | None, is_causal: bool) -> Reach:
    """Read a layer's mask function (``LayerCall.mask``) at far positions — ``FAR`` and a prime distance before it,
    so that a chunked mask shows its chunks: whether the query sees the next position, where the run of positions
    it sees up to its own begins (found by halving, then checked densely near the query and at spaced positions
    back to the start). Runs of different lengths are a chunked mask where the run before a run's start is one chunk
    long and every query's run begins at its chunk's start. No function: the kernel's own causal flag, no window."""
    import torch

    if mask_function is None:
        return Reach(causal=is_causal, window=None)
    mask_function = _readable(mask_function)

    def seen(query: int, columns: torch.Tensor) -> torch.Tensor:
        out = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(query), columns)
        return torch.as_tensor(out).expand(columns.shape).bool()

    def first_seen(query: int) -> int | None:
        """The first position of the contiguous run the query sees up to its own; None where it sees no such run."""
        if not bool(seen(query, torch.tensor([query]))[0]):
            return None  # it does not even see itself
        before, first = -1, query  # the first position seen: after ``before``, at most ``first``
        while first - before > 1:
            middle = (before + first) // 2
            if bool(seen(query, torch.tensor([middle]))[0]):
                first = middle
            else:
                before = middle
        near = torch.arange(max(0, query - 8192), query + 1)
        spaced = torch.unique(torch.cat([near, (query * torch.linspace(0, 1, 4097)).long(), torch.tensor([first])]))
        return first if torch.equal(seen(query, spaced), spaced >= first) else None

    queries = (FAR, FAR - 104_729)
    causal = all(not bool(seen(query, torch.tensor([query + 1]))[0]) for query in queries)
    if not any(bool(seen(query, torch.tensor([query]))[0]) for query in queries):
        return Reach(causal=causal, window=0)  # a query does not even see itself
    firsts = [first_seen(query) for query in queries]
    if None in firsts:
        return Reach(causal=causal, window=None, pattern=False)
    reaches = {None if first == 0 else query - first + 1 for query, first in zip(queries, firsts)}
    if len(reaches) == 1:
        return Reach(causal=causal, window=reaches.pop())
    start = firsts[0]  # a chunk's start, if the mask is chunked; the one before it begins a chunk earlier
    previous = first_seen(start - 1) if start > 0 else None
    chunk = None if previous is None else start - previous
    checks = (*queries, start - 1, start + (chunk or 1) - 1, start + (chunk or 1))
    if chunk and all(first_seen(query) == query - query % chunk for query in checks):
        return Reach(causal=causal, window=None, chunk=chunk)
    return Reach(causal=causal, window=None, pattern=False)


def _readable(function: Callable) -> Callable:
    """A mask function built on the ``meta`` device (``Architecture.read``) made readable: the tensors it holds
    (through the functions it combines, ``and_masks``…) are ``meta`` ones, which have no values. They are what the
    model derived from the probe's input, one sequence without padding (a chunked mask's ``left_padding``: no
    tokens), so they are zeros of their shape. A function holding no such tensor is returned as it is."""
    import types

    import torch

    def rebuilt(value):
        if isinstance(value, torch.Tensor) and value.is_meta:
            return torch.zeros(value.shape, dtype=value.dtype)
        if isinstance(value, (tuple, list)):
            return type(value)(rebuilt(item) for item in value)
        if isinstance(value, types.FunctionType) and value.__closure__:
            cells = tuple(types.CellType(rebuilt(cell.cell_contents)) for cell in value.__closure__)
            if all(new.cell_contents is old.cell_contents for new, old in zip(cells, value.__closure__)):
                return value
            return types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        return value

    return rebuilt(function)


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
        """Position 1's cos (or complex frequencies: Llama 4) in a forward whose furthest position is length − 1,
        per layer kind."""
        positions = torch.tensor([[1, length - 1]])
        out = []
        for kind in kinds:
            rotary = rotary_type(config)
            extra = {} if kind is None else {"layer_type": kind}
            with torch.inference_mode():
                embedding = rotary(torch.zeros(1), positions, **extra)
            table = (embedding[0] if isinstance(embedding, tuple) else embedding)[0, 0]
            out.append(torch.view_as_real(table).float() if table.is_complex() else table.float())
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


@dataclass(frozen=True)
class Rotation:
    """How a model's RoPE turns a head: per layer, the first ``widths[layer]`` of its ``dims[layer]`` dimensions in
    pairs, dimension i with i + width/2 (transformers' ``rotate_half``: llama and most) or, ``interleaved``, 2i with
    2i + 1 (Cohere, GLM); the dimensions beyond pass as they are (Phi-3's partial RoPE). Layers differ in head size
    and width where the model's do (Gemma 4's local and global layers). ``rotates``: per layer, whether it rotates at
    all (a NoPE layer does not); ``scales``: per layer, a norm's weights after RoPE; ``function``: the model's own
    rotary function, taking queries with their heads on ``heads_axis`` (and keys beside them where ``pair``, with
    the call's other keyword arguments ``options``)."""

    interleaved: bool
    widths: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()  # per layer: its head size
    rotates: tuple[bool, ...] = ()
    scales: tuple = field(default=(), compare=False)  # per layer: a norm's weights [d] after RoPE, or None
    function: Callable | None = field(default=None, compare=False)
    heads_axis: int = 1
    pair: bool = True
    options: dict = field(default_factory=dict, compare=False)

    def scale(self, layer: int):
        """Layer ``layer``'s weights of a norm after RoPE ``[d]``, or None."""
        return self.scales[layer] if self.scales else None

    def turn(self, x, embedding):
        """``x`` ``[1, k, n, d]`` turned by the model's own rotary function with ``embedding`` (what its rotary module
        gives for the n positions: cos and sin, or Llama 4's complex frequencies)."""
        arguments = embedding if isinstance(embedding, tuple) else (embedding,)
        laid = x if self.heads_axis == 1 else x.transpose(1, 2)
        if self.pair:
            turned = self.function(laid, laid, *arguments, **self.options)[0]
        else:
            turned = self.function(laid, *arguments, **self.options)
        return turned if self.heads_axis == 1 else turned.transpose(1, 2)

    def tables(self, embedding, layer: int, count: int):
        """Layer ``layer``'s cos and sin ``[count, width]`` (float32) at the ``count`` positions ``embedding`` is of,
        as the model's own function applies them, whatever layout its rotary module gives them in (one entry per
        pair: gpt-oss; the first half spread over the pairs: GLM, Helium, Ernie 4.5; complex: Llama 4): read by
        turning two vectors, 1 and σ (σᵢ = ±1 as ``rotate_half`` signs dimension i), which gives
        y₁ = c + σ·s and y₂ = σ·c − s. A NoPE layer: the identity (cos 1, sin 0)."""
        import torch

        device = _device_of(embedding)
        dim, width = self.dims[layer], self.widths[layer]
        if not self.rotates[layer]:
            return torch.ones(count, width or dim, device=device), torch.zeros(count, width or dim, device=device)
        ones = torch.ones(dim, device=device)
        signs = ones.clone()
        signs[:width] = rotate_half(ones[:width], self.interleaved)
        probes = torch.stack([ones, signs])[None, :, None].expand(1, 2, count, dim).contiguous()
        first, second = self.turn(probes, embedding)[0].float()
        signs = signs[:width]
        first, second = first[:, :width], second[:, :width] * signs
        return (first + second) / 2, signs * (first - second) / 2


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE's pairing of dimension i with i + d/2 (transformers' convention): (x1, x2) → (−x2, x1); ``interleaved``
    (Cohere's): of dimension 2i with 2i + 1, (x₂ᵢ, x₂ᵢ₊₁) → (−x₂ᵢ₊₁, x₂ᵢ)."""
    import torch

    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _device_of(embedding):
    return (embedding[0] if isinstance(embedding, tuple) else embedding).device


def scale_after_rotation(module, call: LayerCall):
    """The weights ``[d]`` of a norm a layer applies to its queries after RoPE (Hunyuan's ``query_layernorm``:
    w ⊙ x / rms(x)), found among the attention module's own submodules as the one that turns what the rotary function
    gave into what the kernel got; None where the kernel gets the function's queries as they are. A norm over the
    head commutes with RoPE up to its weights (rms(R x) = rms(x)): un-rotating divides them out first
    (``attention.unrotate``). Anything else after RoPE is refused, in one line."""
    import torch

    from pkvbench.errors import PkvError

    turned, kernel_query, layer = call.rotary.turned, call.query, call.layer
    if kernel_query is None or kernel_query.shape != turned.shape or torch.equal(kernel_query, turned):
        return None
    tolerance = {"atol": 1e-4, "rtol": 1e-3} if turned.dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for child in module.children():
        if isinstance(child, torch.nn.Linear):
            continue
        laid = turned if call.rotary.heads_axis == 1 else turned.transpose(1, 2)
        try:
            normed = child(laid)
        except (TypeError, RuntimeError):
            continue
        normed = normed if call.rotary.heads_axis == 1 else normed.transpose(1, 2)
        if normed.shape != kernel_query.shape or not torch.allclose(normed, kernel_query, **tolerance):
            continue
        scale = child(torch.ones_like(laid[..., :1, :1, :])).flatten().float()
        weighted = scale * turned.float()  # a norm over the head: the kernel's queries are c·w ⊙ x, c per token
        factor = (weighted * kernel_query.float()).sum(-1, keepdim=True) / (weighted * weighted).sum(-1, keepdim=True)
        if torch.allclose(factor * weighted, kernel_query.float(), **tolerance):
            return scale
    raise PkvError(
        f"layer {layer}'s attention changes its queries after RoPE in a way pkvbench cannot undo (not a norm over "
        "the head); not supported"
    )
