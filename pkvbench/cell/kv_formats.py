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
class CacheGeometry:
    """The shape of a model's cache: layers, KV heads per layer, values per head."""

    layers: int
    kv_heads: int
    head_dim: int
    # Per layer: a mixed model's local layer's reach (the prompt entries its window can still see, all it keeps;
    # ``budgets.layer_budgets``), or None where a policy compresses it.
    local: tuple[int | None, ...] = ()

    def layer_budgets(self, policy, k: int, context_len: int) -> list[int]:
        return layer_budgets(policy, k, context_len, self.layers, self.local)

    def full_bytes(self, context_len: int) -> int:
        """The model's own full cache of ``context_len`` tokens at 16 bits per value (a local layer holding what its
        window sees): what memory fractions are of."""
        local = self.local or (None,) * self.layers
        entries = sum(context_len if reach is None else min(context_len, reach) for reach in local)
        return 2 * entries * self.kv_heads * self.head_dim * SIXTEEN_BITS


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

    def layer_bytes(self, heads: int, head_dim: int, lengths: Sequence[int]) -> int:
        """Bytes one layer's stored tensors hold when its ``heads`` heads keep ``lengths`` entries (each head's
        count; heads that keep fewer are padded to the fullest, as stored), keys and values together."""
        if self.native:  # [heads, n, dim] keys and values; a layer that keeps nothing still stores one masked slot
            return 2 * heads * max(max(lengths), 1) * head_dim * self.bits // 8
        parts = [self.split(n) for n in lengths]
        quantized, residual = max(q for q, _ in parts), max(r for _, r in parts)
        total = 2 * heads * residual * head_dim * SIXTEEN_BITS
        if quantized:
            total += 2 * heads * quantized * head_dim * self.bits // 8  # packed codes of keys and values
            total += 2 * heads * -(-quantized // self.group) * head_dim * SIXTEEN_BITS  # keys' scales and minima
            total += 2 * heads * quantized * (head_dim // self.group) * SIXTEEN_BITS  # values' scales and minima
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
    """Bytes of a cache whose layers keep ``per_layer`` entries in each of ``heads`` heads."""
    return sum(fmt.layer_bytes(heads, head_dim, [n] * heads) for n in per_layer)


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
    per_layer = geometry.layer_budgets(policy, floor, context_len)
    return planned_bytes(fmt, per_layer, heads or geometry.kv_heads, geometry.head_dim)


def memory_plan(
    policy, budget: Budget, context_len: int, geometry: CacheGeometry, fmt: KVFormat, heads: int | None = None
) -> LayerPlan:
    """The most entries ``policy`` can keep in ``fmt`` within a memory ``budget`` (as close to it as whole entries
    allow): every layer's tensors counted (codes, scales, minima, residual, PyramidKV's per-layer budgets). ``heads``:
    the cache's heads per layer (the query heads for a policy that keeps one set per query head). Raises
    ``MemoryTooSmall`` when even the policy's floor does not fit."""
    heads = heads or geometry.kv_heads
    full = geometry.full_bytes(context_len)
    target = budget.target_bytes(full)

    def cost(k: int) -> int:
        return planned_bytes(fmt, geometry.layer_budgets(policy, k, context_len), heads, geometry.head_dim)

    k = largest(min(max(policy.min_budget, 1), context_len), context_len, lambda k: cost(k) <= target)
    if k is None:
        needed = floor_bytes(policy, context_len, geometry, fmt, heads)
        raise MemoryTooSmall(budget, needed, full, f"{policy.label} at {fmt} bits on {context_len} tokens")
    per_layer = geometry.layer_budgets(policy, k, context_len)
    return LayerPlan(requested=k, effective=k, per_layer=per_layer, context_len=context_len, target_bytes=target)
