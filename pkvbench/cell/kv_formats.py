"""Storage formats: how a compressed cache stores its kept entries (``KVFormat``: the model's own dtype, 16 bits,
or KIVI's 8/4/2-bit integers), the bytes a cache of some entries takes in one (``CacheGeometry``, ``planned_bytes``),
and how many entries a memory budget buys (``memory_plan``).

Pure arithmetic, no tensors: ``codecs/kivi.py`` is the quantizer itself, and a test holds these byte counts against the
stored tensors' own sizes (docs/memory.md). A memory budget's parsing is a budget's (``budgets.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pkvbench.cell.budgets import MEMORY_PREFIX, Budget, LayerPlan, layer_budgets
from pkvbench.errors import PkvError

KV_BITS = (2, 4, 8, 16, 32)  # what --kv-bits accepts; below 16 KIVI's integers, 32 only where the model computes so
QUANTIZED_BITS = (2, 4, 8)
DEFAULT_GROUP = 32  # KIVI's G: tokens per key group (per channel), channels per value group (per token)
DEFAULT_RESIDUAL = 128  # KIVI's R: the most recent entries kept at 16 bits
SIXTEEN_BITS = 2  # bytes of a value at 16 bits: scales, minima, the residual, and the reference full cache


@dataclass(frozen=True)
class LayerShape:
    """One layer of per-token entries: the heads its cache holds and the values of each entry's key and of its value
    (a latent (MLA) cache: one "head", the latent as its key and the shared rotary key as its value)."""

    heads: int
    key_dim: int
    value_dim: int
    # A mixed model's local (sliding) layer's reach: the prompt entries its window can still see, all it keeps
    # (``budgets.layer_budgets``); None where a policy compresses the layer.
    reach: int | None = None

    def full_bytes(self, context_len: int) -> int:
        """Its entries of ``context_len`` tokens at 16 bits per value (a local layer: what its window sees)."""
        entries = context_len if self.reach is None else min(context_len, self.reach)
        return self.heads * entries * (self.key_dim + self.value_dim) * SIXTEEN_BITS


@dataclass(frozen=True)
class CacheGeometry:
    """The shape of a model's cache: its layers of per-token entries in depth order (a hybrid model's attention
    layers; each its own heads and sizes), and the bytes of the fixed per-sequence state its recurrent and
    convolution layers keep whatever the prompt's length (kept whole, in the dtypes the model keeps them; None
    where that is not known before the model loads)."""

    layers: tuple[LayerShape, ...]
    state_bytes: int | None = 0

    @classmethod
    def uniform(cls, layers: int, kv_heads: int, head_dim: int, local: Sequence[int | None] = ()) -> CacheGeometry:
        """``layers`` layers of ``kv_heads`` heads of ``head_dim`` values (``local``: each one's reach), no state."""
        local = tuple(local) or (None,) * layers
        return cls(tuple(LayerShape(kv_heads, head_dim, head_dim, reach) for reach in local))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def local(self) -> tuple[int | None, ...]:
        return tuple(layer.reach for layer in self.layers)

    def layer_budgets(self, policy, k: int, context_len: int) -> list[int]:
        return layer_budgets(policy, k, context_len, self.num_layers, self.local)

    def full_bytes(self, context_len: int) -> int:
        """The model's own full cache of ``context_len`` tokens at 16 bits per value (a local layer holding what its
        window sees), and the state: what memory fractions are of."""
        return sum(layer.full_bytes(context_len) for layer in self.layers) + (self.state_bytes or 0)

    def planned_bytes(self, fmt: KVFormat, per_layer: Sequence[int], heads: int | None = None) -> int:
        """Bytes of a cache whose layers keep ``per_layer`` entries in each head (``heads``: as many heads in every
        layer, one set per query head; else each layer's own), and the state."""
        entries = sum(
            fmt.layer_bytes(heads or layer.heads, layer.key_dim, [n] * (heads or layer.heads), layer.value_dim)
            for layer, n in zip(self.layers, per_layer)
        )
        return entries + (self.state_bytes or 0)


@dataclass(frozen=True)
class KVFormat:
    """How a compressed cache stores its kept entries.

    ``native``: the model's own cache at its dtype (``bits`` is the dtype's width): today's cache, token for token.
    ``bits`` 16 (where the model computes wider): every entry in 16 bits, widened for attention. ``bits`` 8/4/2:
    KIVI — per head, the last ``residual`` kept entries in 16 bits, the ones before them as packed integers, keys per
    channel in groups of ``group`` tokens, values per token in groups of ``group`` channels, each group's scale and
    minimum in 16 bits (``pkvbench.codecs.kivi``)."""

    bits: int
    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    native: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits in QUANTIZED_BITS

    def split(self, length: int) -> tuple[int, int]:
        """A head's ``length`` kept entries → (quantized, residual): the last ``residual`` stay in 16 bits."""
        if not self.quantized:
            return 0, length
        residual = min(self.residual, length)
        return length - residual, residual

    def layer_bytes(self, heads: int, head_dim: int, lengths: Sequence[int], value_dim: int | None = None) -> int:
        """Bytes one layer's stored tensors hold when its ``heads`` heads keep ``lengths`` entries (each head's
        count; heads that keep fewer are padded to the fullest, as stored), keys (``head_dim`` values each) and
        values (``value_dim``, default ``head_dim``) together."""
        value_dim = head_dim if value_dim is None else value_dim
        width = head_dim + value_dim
        if self.native:  # [heads, n, dim] keys and values; a layer that keeps nothing still stores one masked slot
            return heads * max(max(lengths), 1) * width * self.bits // 8
        parts = [self.split(n) for n in lengths]
        quantized, residual = max(q for q, _ in parts), max(r for _, r in parts)
        total = heads * residual * width * SIXTEEN_BITS
        if quantized:
            total += heads * quantized * width * self.bits // 8  # packed codes of keys and values
            total += 2 * heads * -(-quantized // self.group) * head_dim * SIXTEEN_BITS  # keys' scales and minima
            total += 2 * heads * quantized * (value_dim // self.group) * SIXTEEN_BITS  # values' scales and minima
        return total

    def __str__(self) -> str:
        """``4`` (KIVI's defaults), ``4 g64 r32``, ``16``, ``32``."""
        if not self.quantized:
            return str(self.bits)
        extra = (f" g{self.group}" if self.group != DEFAULT_GROUP else "") + (
            f" r{self.residual}" if self.residual != DEFAULT_RESIDUAL else ""
        )
        return f"{self.bits}{extra}"


def largest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest k in [low, high] with ``fits(k)``, for ``fits`` true up to some k and false after (binary
    search, then a step up while the next one fits too: a few bytes of rounding may break monotony); None if even
    ``low`` does not fit."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def planned_bytes(fmt: KVFormat, per_layer: Sequence[int], heads: int, head_dim: int) -> int:
    """Bytes of a cache whose layers keep ``per_layer`` entries in each of ``heads`` heads of ``head_dim`` values
    (``CacheGeometry.planned_bytes``: each layer its own shape, and the state)."""
    return CacheGeometry.uniform(len(per_layer), heads, head_dim).planned_bytes(fmt, per_layer)


class MemoryTooSmall(PkvError):
    """A memory budget below what a policy's smallest cache takes (its floor: window, sinks) in a format."""

    def __init__(self, budget: Budget, needed: int, full_bytes: int, what: str):
        self.needed = needed  # bytes of the smallest cache
        self.smallest = needed / full_bytes if isinstance(budget.value, float) else needed
        super().__init__(
            f"--memory {str(budget).removeprefix(MEMORY_PREFIX)}: {what} needs at least {needed} bytes "
            f"({needed / full_bytes:.4g} of the full cache)"
        )


def floor_bytes(policy, context_len: int, geometry: CacheGeometry, fmt: KVFormat, heads: int | None = None) -> int:
    """The bytes of the smallest cache ``policy`` keeps (its floor: window, sinks) in ``fmt``."""
    floor = min(max(policy.min_budget, 1), context_len)
    return geometry.planned_bytes(fmt, geometry.layer_budgets(policy, floor, context_len), heads)


def memory_plan(
    policy, budget: Budget, context_len: int, geometry: CacheGeometry, fmt: KVFormat, heads: int | None = None
) -> LayerPlan:
    """The most entries ``policy`` can keep in ``fmt`` within a memory ``budget`` (as close to it as whole entries
    allow): every layer's tensors counted (codes, scales, minima, residual, PyramidKV's per-layer budgets), and the
    state of a hybrid model's recurrent layers, kept whole. ``heads``: the cache's heads per layer where not the
    layers' own (the query heads for a policy that keeps one set per query head). Raises ``MemoryTooSmall`` when even
    the policy's floor does not fit."""
    full = geometry.full_bytes(context_len)
    target = budget.target_bytes(full)

    def cost(k: int) -> int:
        return geometry.planned_bytes(fmt, geometry.layer_budgets(policy, k, context_len), heads)

    k = largest(min(max(policy.min_budget, 1), context_len), context_len, lambda k: cost(k) <= target)
    if k is None:
        needed = floor_bytes(policy, context_len, geometry, fmt, heads)
        raise MemoryTooSmall(budget, needed, full, f"{policy.label} at {fmt} bits on {context_len} tokens")
    per_layer = geometry.layer_budgets(policy, k, context_len)
    return LayerPlan(requested=k, effective=k, per_layer=per_layer, context_len=context_len, target_bytes=target)
