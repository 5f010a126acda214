"""Compressed caches stored in fewer bits: one row's stored form, and the layer a batch of them decodes from.

A policy selects its entries from full-precision statistics; ``StoredEntries.store`` then keeps them in a
``kv_formats.KVFormat``: 16 bits (every entry, widened for attention where the model computes in float32), KIVI's
8/4/2-bit integers (``pkvbench.codecs.kivi``) for all but each head's last R entries, which stay in 16 bits (the
residual), or every entry in FP8 (``codecs.fp8``) or TurboQuant (``codecs.turboquant``). A ``LayerCodec`` per layer
is what knows a codec: how entries are packed and read back, and what a layer shares among them (FP8's scales,
TurboQuant's rotations). The stored tensors are all there is: ``nbytes`` is their sum, what a row's ``kv_bytes``
records (TurboQuant's rotations and QJL's projections are drawn again from their seed, not stored).

``QuantizedLayer`` (in the style of transformers' ``cache_utils`` quantized layers) holds one layer of a batch of
stored caches — rows of one sample's grid, padded to the batch's longest and masked — and attends over them by
dequantizing the packed entries at every step: nothing wider than the stored form is kept between steps. New tokens
(a fed question, the answer) go into the residual in 16 bits, through a ``RaggedLayer`` that already knows how rows
and heads of different lengths take new tokens and how to mask them. Keys are stored after RoPE, so attention does
not depend on the order of the columns: the packed part comes first, then the residual, with masked padding between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from pkvbench.cell import kv_formats
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.codecs import fp8, turboquant
from pkvbench.codecs.kivi import Quantized, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from pkvbench.engine.cache import DecodingLayer, RaggedLayer, host_copy
from pkvbench.engine.recurrent import LayerState, state_bytes
from pkvbench.errors import PkvError

Packed = Quantized | fp8.Fp8 | turboquant.Rotated  # a codec's stored tensors (``tensors``), rebuilt from them


class LayerCodec(Protocol):
    """One layer's codec: how its kept keys and values ``[heads, n, dim]`` are packed and read back."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Packed, Packed]: ...

    def width(self, columns: int) -> int:
        """Columns attention reads for ``columns`` packed entries (KIVI's keys: whole groups)."""

    def decode(self, part: int, packed: Packed, dtype: torch.dtype, out: torch.Tensor) -> None:
        """The keys (``part`` 0) or values (1) of a row or batch ``[..., columns, dim]`` into ``out``
        ``[..., width, dim]`` in ``dtype``; columns past the packed ones finite (they are masked)."""


@dataclass(frozen=True)
class KiviCodec:
    fmt: KVFormat
    dtype: torch.dtype  # of the scales and minima

    def encode(self, keys, values):
        fmt = self.fmt
        return quantize_keys(keys, fmt.bits, fmt.group, self.dtype), quantize_values(
            values, fmt.bits, fmt.group, self.dtype
        )

    def width(self, columns: int) -> int:
        return -(-columns // self.fmt.group) * self.fmt.group

    def decode(self, part, packed, dtype, out):
        fmt = self.fmt
        if part == 0:
            dequantize_keys(packed, fmt.bits, fmt.group, dtype, out=out)
            return
        columns = packed.codes.shape[-2]
        dequantize_values(packed, fmt.bits, fmt.group, dtype, out=out[..., :columns, :])
        out[..., columns:, :].zero_()  # masked, but a value must be finite all the same


@dataclass(frozen=True)
class Fp8Codec:
    variant: str  # e4m3, e5m2
    scales: tuple[torch.Tensor, torch.Tensor]  # the layer's key and value scales

    def encode(self, keys, values):
        return tuple(fp8.quantize(x, scale, self.variant) for x, scale in zip((keys, values), self.scales))

    def width(self, columns: int) -> int:
        return columns

    def decode(self, part, packed, dtype, out):
        fp8.dequantize(packed, self.variant, dtype, out=out)


@dataclass(frozen=True)
class TurboQuantCodec:
    bits: int
    dtype: torch.dtype  # of the norms
    rotation: torch.Tensor  # [heads, dim, dim]: keys and values alike
    projection: torch.Tensor | None  # QJL's, for the keys

    def encode(self, keys, values):
        return (
            turboquant.quantize(keys, self.bits, self.rotation, self.dtype, self.projection),
            turboquant.quantize(values, self.bits, self.rotation, self.dtype),
        )

    def width(self, columns: int) -> int:
        return columns

    def decode(self, part, packed, dtype, out):
        turboquant.dequantize(packed, self.rotation, dtype, self.projection if part == 0 else None, out=out)


FP8_VARIANTS = {kv_formats.FP8: "e4m3", kv_formats.FP8_E5M2: "e5m2"}


def layer_codec(
    fmt: KVFormat, layer: int, dtype: torch.dtype, keys: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor]
) -> LayerCodec:
    """Layer ``layer``'s codec in ``fmt`` for kept ``keys`` ``[heads, n, dim]`` (16-bit parts in ``dtype``);
    ``prompt``: the layer's keys and values before any was dropped (what FP8 scales are calculated from)."""
    if fmt.codec in FP8_VARIANTS:
        if fmt.scale == kv_formats.PROMPT_SCALE:
            scales = (fp8.calculated_scale(prompt[0], fp8.KEY_RANGE), fp8.calculated_scale(prompt[1], fp8.VALUE_RANGE))
        else:
            scales = (fp8.unit_scale(keys.device), fp8.unit_scale(keys.device))
        return Fp8Codec(FP8_VARIANTS[fmt.codec], scales)
    if fmt.codec == kv_formats.TURBOQUANT:
        heads, _, dim = keys.shape
        rotation = turboquant.rotations(dim, heads, fmt.seed, layer, keys.device)
        projection = turboquant.projections(dim, heads, fmt.seed, layer, keys.device) if fmt.qjl else None
        return TurboQuantCodec(fmt.bits, dtype, rotation, projection)
    return KiviCodec(fmt, dtype)


@dataclass
class StoredLayer:
    """One layer of one row: per head, ``quantized[h]`` entries packed (``keys``/``values``: None when no head has
    any) and then ``residual[h]`` entries in 16 bits (``residual_keys``/``residual_values`` ``[heads, r, dim]``);
    heads with fewer are padded to the fullest. ``codec`` reads the packed ones back."""

    keys: Packed | None
    values: Packed | None
    quantized: torch.Tensor  # [heads] long
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    residual: torch.Tensor  # [heads] long
    # Each packed and residual column's original position ([heads, columns], padding repeating a head's last): what
    # a sliding-window layer's mask reads; bookkeeping, not stored bytes.
    packed_positions: torch.Tensor | None = None
    residual_positions: torch.Tensor | None = None
    codec: LayerCodec | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What the layer stores: packed codes, scales and minima, and the residual."""
        packed = [t for q in (self.keys, self.values) if q is not None for t in q.tensors]
        return [*packed, self.residual_keys, self.residual_values]

    @property
    def lengths(self) -> torch.Tensor:
        return self.quantized + self.residual

    @property
    def columns(self) -> int:
        """Stored entries per head, padding included."""
        return (self.keys.codes.shape[1] if self.keys is not None else 0) + self.residual_keys.shape[1]


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor.gather(1, index[:, :, None].expand(-1, -1, tensor.shape[-1]))


def _sixteen_bits(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    stored = tensor.to(dtype)
    if not bool(torch.isfinite(stored).all()):
        raise PkvError(f"the cache holds values beyond {dtype}'s range; it cannot be stored in 16 bits")
    return stored


def store_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    fmt: KVFormat,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
    codec: LayerCodec | None = None,
) -> StoredLayer:
    """Store one layer's kept ``keys``/``values`` ``[heads, n, dim]`` (head h's in ``[:lengths[h]]``, at original
    ``positions`` ``[heads, n]``, default 0 … n−1) in ``fmt`` through ``codec`` (default: the layer's with FP8 scales
    from the kept entries), 16-bit parts in ``dtype``."""
    if positions is None:
        positions = torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
    if codec is None and fmt.quantized:
        codec = layer_codec(fmt, 0, dtype, keys, (keys, values))
    lengths = lengths.to(device=keys.device, dtype=torch.long)
    residual = lengths.clamp(max=fmt.recent) if fmt.quantized else lengths
    quantized = lengths - residual
    width, tail = int(quantized.max()), int(residual.max())
    # Each head's packed part is its first quantized[h] entries, padded with its last one (a group's minimum and
    # maximum stay its own entries'); its residual the entries after them, padded likewise. Padding is masked.
    tail_index = (quantized[:, None] + torch.arange(tail, device=keys.device)).minimum(
        (lengths - 1).clamp(min=0)[:, None]
    )
    packed_keys = packed_values = packed_positions = None
    if width:
        index = torch.arange(width, device=keys.device).minimum((quantized - 1).clamp(min=0)[:, None])
        packed_keys, packed_values = codec.encode(_gather(keys, index), _gather(values, index))
        packed_positions = positions.to(keys.device).gather(1, index)
    return StoredLayer(
        packed_keys,
        packed_values,
        quantized,
        _sixteen_bits(_gather(keys, tail_index), dtype),
        _sixteen_bits(_gather(values, tail_index), dtype),
        residual,
        packed_positions,
        positions.to(keys.device).gather(1, tail_index),
        codec,
    )


@dataclass
class StoredEntries:
    """One row's compressed cache as stored in ``format`` (the decoder's counterpart of ``decoding.KeptEntries``):
    per layer a ``StoredLayer``; ``dtype`` is what attention computes in."""

    layers: list[StoredLayer]
    format: KVFormat
    dtype: torch.dtype
    states: dict[int, LayerState] = field(default_factory=dict)  # a hybrid model's, as the model keeps them
    storage: ClassVar[str] = "stored"  # how a batch of them decodes (layers.LAYER_KINDS)

    @classmethod
    def store(cls, kept, fmt: KVFormat, dtype: torch.dtype, prompt=None) -> StoredEntries:
        """``kept`` (``KeptEntries``, the gathered full-precision entries) stored in ``fmt``, 16 bits as ``dtype``.
        ``prompt``: per layer, its keys and values before any was dropped (default: the kept ones)."""
        layers = []
        for index, (keys, values) in enumerate(zip(kept.keys, kept.values)):
            lengths = kept.lengths[index] if kept.lengths is not None else torch.full((keys.shape[0],), keys.shape[1])
            positions = kept.positions[index] if kept.positions is not None else None
            own = prompt[index] if prompt is not None else (keys, values)
            codec = layer_codec(fmt, index, dtype, keys, own) if fmt.quantized else None
            layers.append(store_layer(keys, values, lengths, fmt, dtype, positions, codec))
        return cls(layers, fmt, kept.keys[0].dtype, kept.states)

    @property
    def nbytes(self) -> int:
        """Bytes the stored tensors hold (codes, scales, minima, residual, padding), from the tensors themselves, and
        the states (kept whole, in the model's own dtypes)."""
        return sum(t.nbytes for layer in self.layers for t in layer.tensors) + state_bytes(self.states)

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(layer.residual_keys.shape[0] for layer in self.layers)

    def stored(self, layer: int) -> int:
        return self.layers[layer].columns

    @property
    def entries(self) -> int:
        return int(sum(int(layer.lengths.sum()) for layer in self.layers))

    @property
    def lengths(self) -> list[torch.Tensor]:
        return [layer.lengths for layer in self.layers]


def _padded(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Row tensors stacked along a new batch axis, each zero-padded along ``dim`` (of the row) to the longest."""
    longest = max(t.shape[dim] for t in tensors)
    out = tensors[0].new_zeros((len(tensors), *tensors[0].shape[:dim], longest, *tensors[0].shape[dim + 1 :]))
    for row, tensor in enumerate(tensors):
        out[row].narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return out


class QuantizedLayer(DecodingLayer):
    """One layer of a batch of stored caches (rows of one format), decoded from their packed form at every step."""

    is_sliding = False

    def __init__(self, rows: list[StoredLayer], fmt: KVFormat, dtype: torch.dtype, room: int, kv_heads: int):
        super().__init__()
        self.format, self.dtype = fmt, dtype
        self.is_initialized = True
        self.quantized = torch.stack([row.quantized for row in rows])  # [batch, heads]
        # Its host copy: what the mask's shape and ``held`` depend on, read back once here and never while decoding
        # (as ``RaggedLayer.host_lengths``; packed counts only change when rows leave the batch).
        self.host_quantized = host_copy(self.quantized)
        self.codec = rows[0].codec
        self.packed_columns = max((row.keys.codes.shape[1] if row.keys is not None else 0) for row in rows)
        # Columns of the packed part as attention sees it (KIVI's keys: whole groups, the last one's padding masked).
        self.width = self.codec.width(self.packed_columns) if self.packed_columns else 0
        self.packed: list[Packed] = []  # the keys', then the values', each tensor padded to the batch's widest
        if self.width:
            for part in ("keys", "values"):
                stored = [getattr(row, part) or _empty_like(rows, part) for row in rows]
                self.packed.append(type(stored[0])(*(_padded(list(t), 1) for t in zip(*(s.tensors for s in stored)))))
        residual_keys = _padded([row.residual_keys for row in rows], 1)
        residual_values = _padded([row.residual_values for row in rows], 1)
        lengths = torch.stack([row.residual for row in rows])
        # Each row's own packed bytes (the batch pads rows to the widest; a row alone would not hold that padding).
        self.packed_bytes = host_copy(
            [sum(t.nbytes for q in (row.keys, row.values) if q is not None for t in q.tensors) for row in rows]
        )
        self.residual = self._residual_layer(rows, residual_keys, residual_values, lengths, room, kv_heads)
        self.device = residual_keys.device

    def _residual_layer(self, rows, keys, values, lengths, room: int, kv_heads: int) -> RaggedLayer:
        """Where the residual and new tokens live (a sliding-window layer's kind also knows their positions)."""
        return RaggedLayer(keys, values, lengths, room, kv_heads)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    @property
    def lengths(self) -> torch.Tensor:
        return self.residual.lengths

    def share_memo(self, memo: dict) -> None:
        """The step's masks and indices are the residual's (``RaggedLayer.step_memo``): layers of the same counts
        build them once per step."""
        self.residual.share_memo(memo)

    def _assemble(self, tail: torch.Tensor, part: int) -> torch.Tensor:
        """What attention reads: the packed keys (``part`` 0) or values (1) dequantized into the first ``width``
        columns of a fresh buffer, the residual widened after them."""
        batch, heads, columns, dim = tail.shape
        out = torch.empty((batch, heads, self.width + columns, dim), dtype=self.dtype, device=tail.device)
        self.codec.decode(part, self.packed[part], self.dtype, out[:, :, : self.width])
        out[:, :, self.width :].copy_(tail)
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        stored = self.residual.keys.dtype
        tail_keys, tail_values = self.residual.update(key_states.to(stored), value_states.to(stored))
        if not self.width:
            return tail_keys.to(self.dtype), tail_values.to(self.dtype)
        return self._assemble(tail_keys, 0), self._assemble(tail_values, 1)

    def attention_mask(self) -> torch.Tensor | None:
        """As ``RaggedLayer.attention_mask``, over the packed columns (each row and head its own count) followed by
        the residual's."""
        tail = self.residual.attention_mask()
        if not self.width:
            return tail
        if tail is None and (self.host_quantized == self.width).all():
            return None
        packed = self.host_quantized.tobytes(), self.width
        return self.residual._memo("packed mask", lambda: self._build_mask(tail), *packed)

    def _build_mask(self, tail: torch.Tensor | None) -> torch.Tensor:
        batch, new = self.host_quantized.shape[0], self.residual._new
        per_head = not (self.host_quantized == self.host_quantized[:, :1]).all()
        counts = self.quantized if per_head else self.quantized[:, :1]
        packed = torch.arange(self.width, device=counts.device) < counts[..., None]  # [batch, 1 or heads, width]
        if tail is None:
            tail = torch.ones((batch, 1, new, self.residual.keys.shape[2]), dtype=torch.bool, device=counts.device)
        heads = max(packed.shape[1], tail.shape[1])
        packed = packed[:, :, None].expand(batch, heads, new, self.width)
        return torch.cat([packed, tail.expand(batch, heads, -1, -1)], dim=-1)

    def held(self, row: int) -> tuple[int, int]:
        """As ``RaggedLayer.held``: the packed entries and bytes, then the residual's."""
        entries, stored = self.residual.held(row)
        return entries + int(self.host_quantized[row].sum()), stored + int(self.packed_bytes[row])

    def select_rows(self, rows: torch.Tensor, host_rows) -> None:
        host = host_copy(host_rows)
        self.packed_bytes, self.host_quantized = self.packed_bytes[host], self.host_quantized[host]
        self.quantized = self.quantized[rows]
        self.packed = [type(packed)(*(t[rows] for t in packed.tensors)) for packed in self.packed]
        self.residual.select_rows(rows, host_rows)

    def get_seq_length(self) -> int:
        return self.width + self.residual.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + self.residual.get_mask_sizes(query_length)[0], 0

    def get_max_length(self) -> int:
        return -1


def _empty_like(rows: list[StoredLayer], part: str) -> Packed:
    """A row of a batch whose other rows pack entries but it packs none: zero-length packed tensors of their shape."""
    model = next(getattr(row, part) for row in rows if getattr(row, part) is not None)
    return type(model)(*(t[:, :0] for t in model.tensors))
