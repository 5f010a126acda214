"""Budgets: parsing ``--budget`` values and splitting a budget over layers.

A value below 1 is a fraction of the prompt (k = round(f·T) entries per KV head per layer, on average); a value of 1
or more is an integer count of entries. The same functions back ``pkvbench budgets`` and the engine.

A budget may also be memory (``--memory``, written ``mem0.05`` or ``mem2MiB`` in rows): bytes rather than entries.
How many bytes a cache of some entries takes in a storage format (``KVFormat``: the model's own dtype, 16 bits, or
KIVI's 8/4/2-bit integers) and how many entries a memory budget buys are here too (``memory_plan``), as pure
arithmetic that a test holds against the stored tensors' own sizes (docs/memory.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pkvbench.config import as_list, float_text, int_text
from pkvbench.errors import PkvError

# kvpress's spelling of a budget: the compression ratio r, the fraction of the cache *removed*; kept entries are
# int(T·(1 − r)), truncated as kvpress's ScorerPress does. Written "cr0.25".
REMOVED_PREFIX = "cr"
# A memory budget in rows and keys: "mem0.05" (5% of the full cache's bytes at 16 bits per value) or "mem2MiB".
MEMORY_PREFIX = "mem"
# The budget that keeps every entry: the full cache's one point per storage format in a memory grid.
ALL = "all"
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class Budget:
    """A requested budget, as the user gave it."""

    value: float | int
    # How a fraction of the prompt becomes whole entries: "half-up" (pkvbench), or "half-even" (Python's round), as
    # the reference code's --max_capacity_prompts_ratio does.
    rounding: str = field(default="half-up", compare=False)
    removed: bool = False  # value is kvpress's compression ratio: the fraction removed
    memory: bool = False  # value is bytes: a fraction of the full cache at 16 bits (below 1) or a count (``int``)

    @classmethod
    def parse(cls, text: str) -> Budget:
        text = str(text).strip()
        if text == ALL:
            return cls(math.inf)
        if text.startswith(MEMORY_PREFIX):
            return parse_memory(text[len(MEMORY_PREFIX) :])
        if text.startswith(REMOVED_PREFIX):
            try:
                ratio = float_text(text[len(REMOVED_PREFIX) :])
            except ValueError:
                ratio = float("nan")
            if not 0 <= ratio < 1:
                raise PkvError(
                    f"budget {text!r}: a compression ratio (the fraction removed) is cr0 .. cr0.99, e.g. cr0.5"
                )
            return cls(ratio, removed=True)
        try:
            number = float_text(text)
        except ValueError:
            raise PkvError(
                f"budget {text!r} is not a number; use a fraction below 1 (0.12) or an integer entry count (128)"
            ) from None
        if not math.isfinite(number) or number <= 0:
            raise PkvError(
                f"budget {text!r} must be positive: a fraction below 1 (0.12) or an integer entry count (128)"
            )
        if number >= 1:
            if number != int(number):
                raise PkvError(f"budget {text!r}: a budget of 1 or more counts entries and must be an integer")
            return cls(int(number))
        return cls(number)

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float) and not self.removed and not self.keeps_all

    @property
    def keeps_all(self) -> bool:
        return self.value == math.inf

    @property
    def recorded(self) -> float | int | str:
        """What a result row's ``budget`` holds: the number as given, or the ``cr…`` / ``mem…`` / ``all`` spelling."""
        return str(self) if self.removed or self.memory or self.keeps_all else self.value

    def target_bytes(self, full_bytes: int) -> int:
        """A memory budget's bytes, given the full cache's bytes at 16 bits per value."""
        if not self.memory:
            raise ValueError(f"budget {self} counts entries, not bytes")
        return int(self.value) if isinstance(self.value, int) else math.floor(self.value * full_bytes)

    def entries(self, context_len: int) -> int:
        """Mean entries per KV head per layer for a prompt of ``context_len`` tokens (before any policy floor)."""
        if self.memory:
            raise ValueError(f"budget {self} is memory: the entries it buys depend on the cache's format")
        if self.keeps_all:
            return context_len
        if self.removed:
            return max(1, int(context_len * (1 - self.value)))
        if self.is_fraction:
            exact = self.value * context_len
            return max(1, round(exact) if self.rounding == "half-even" else math.floor(exact + 0.5))
        return int(self.value)

    def __str__(self) -> str:
        if self.keeps_all:
            return ALL
        if self.memory:
            return MEMORY_PREFIX + (f"{self.value:g}" if isinstance(self.value, float) else byte_size(self.value))
        if self.removed:
            return f"{REMOVED_PREFIX}{self.value:g}"
        return f"{self.value:g}" if self.is_fraction else str(self.value)


def byte_size(count: int) -> str:
    """Bytes in the largest unit that divides them exactly (binary units first): ``2MiB``, ``1500KB``, ``7B``."""
    for unit in ("GiB", "MiB", "KiB", "GB", "MB", "KB"):
        if count % BYTE_UNITS[unit] == 0:
            return f"{count // BYTE_UNITS[unit]}{unit}"
    return f"{count}B"


def parse_memory(text: str) -> Budget:
    """``--memory`` values: a fraction of the full cache's bytes at 16 bits per value (0.05), or a size with a unit
    (2MiB, 500KB, 65536B)."""
    text = str(text).strip()
    hint = "a fraction of the full cache's bytes (0.05 = 5%), or a size with a unit (2MiB, 500KB)"
    sized = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)", text)
    if sized:
        unit = {name.lower(): name for name in BYTE_UNITS}.get(sized.group(2).lower())
        if unit is None:
            raise PkvError(f"--memory {text!r}: unknown unit {sized.group(2)!r}; valid: {', '.join(BYTE_UNITS)}")
        count = float(sized.group(1)) * BYTE_UNITS[unit]
        if not math.isfinite(count) or count < 1:
            raise PkvError(f"--memory {text!r}: a size must be at least one byte")
        return Budget(round(count), memory=True)
    try:
        fraction = float_text(text)
    except ValueError:
        raise PkvError(f"--memory {text!r} is not {hint}") from None
    if not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise PkvError(f"--memory {text!r}: give {hint}; a fraction is above 0 and at most 1")
    return Budget(fraction, memory=True)


def budget_label(value: float | int | str) -> str:
    """How a budget value is written in keys and tables: ``128``, ``0.12``, ``cr0.5``."""
    return str(Budget.parse(value) if isinstance(value, str) else Budget(value))


def parse_budgets(values: list[str] | str, rounding: str = "half-up") -> list[Budget]:
    items = [str(v).strip() for v in (values.split(",") if isinstance(values, str) else values)]
    if not any(items):
        raise PkvError("--budget is empty; give one or more budgets, e.g. 128,0.12")
    if not all(items):
        raise PkvError(f"--budget {','.join(items)!r} has an empty item; remove the extra comma")
    parsed = [replace(Budget.parse(item), rounding=rounding) for item in items]
    if any(b.memory for b in parsed):
        raise PkvError("--budget counts entries; memory budgets go in --memory (0.05, 2MiB)")
    return list(dict.fromkeys(parsed))


def parse_memory_budgets(values: list[str] | str) -> list[Budget]:
    """``--memory 0.05,0.12`` or ``--memory 2MiB``: memory budgets, each once."""
    items = [str(v).strip() for v in (values.split(",") if isinstance(values, str) else values)]
    if not all(items):
        raise PkvError(f"--memory {','.join(items)!r} is empty or has an empty item; e.g. --memory 0.05,0.12")
    return list(dict.fromkeys(parse_memory(item) for item in items))


def uniform(k: int, context_len: int, num_layers: int) -> list[int]:
    return [min(k, context_len)] * num_layers


def apportion(shares: list[float], total: int) -> list[int]:
    """Integers that sum to ``total``, each the floor of its share or one more (largest remainders first, earlier
    index on ties). A non-increasing ``shares`` gives a non-increasing result."""
    floors = [math.floor(s) for s in shares]
    remainder = total - sum(floors)
    by_fraction = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in by_fraction[:remainder]:
        floors[i] += 1
    return floors


def pyramid(k: int, context_len: int, num_layers: int, *, window: int, beta: float) -> list[int]:
    """PyramidKV's per-layer budgets: ``window`` plus an arithmetic sequence, largest at the bottom (layer 0).

    Beyond the window the top layer gets (k-w)/beta and the bottom layer 2(k-w) - (k-w)/beta, with the layers in
    between on the line joining them, so the mean is exactly k-w. If the bottom layer's share would exceed what the
    prompt holds (T-w), it is set to T-w and the top one recomputed to keep the total (the paper code's clamp).
    The paper's code floors the step between layers and so overspends (mean 133.5 for k=128 over 32 layers); here
    the shares are apportioned to integers that sum to exactly L·k.
    """
    if k >= context_len:
        return [context_len] * num_layers
    extra = k - window
    if extra <= 0 or num_layers == 1:
        return [min(k, context_len)] * num_layers
    top = extra / beta
    bottom = 2 * extra - top
    if bottom > context_len - window:
        bottom = context_len - window
        top = 2 * extra - bottom
    step = (bottom - top) / (num_layers - 1)
    shares = [bottom - layer * step for layer in range(num_layers)]
    return [window + n for n in apportion(shares, extra * num_layers)]


def pyramid_reference(k: int, context_len: int, num_layers: int, *, window: int, beta: float) -> list[int]:
    """PyramidKV's per-layer budgets as the paper's code computes them (Zefan-Cai/KVCache-Factory,
    ``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster.update_kv``; the same since ``5a1f543``, 2024-09-30, and for
    32-layer models the same as the first release, whose divisor 31 is L - 1).

    With k the budget (window included) and T the prompt: nothing is dropped if T < k; every layer keeps k if
    T < 2(k - w); otherwise min = floor((k - w) / beta), max = 2(k - w) - min, clamped to T - w (then min = 2(k - w)
    - max), step = floor((max - min) / (L - 1)), and layer l keeps w + max - l·step. The floored step makes the total
    at least L·k (mean 133.5 for k = 128 over 32 layers at T = 8000).
    """
    if context_len < k:
        return [context_len] * num_layers
    extra = k - window
    if context_len < 2 * extra or num_layers == 1:
        return [k] * num_layers
    least = math.floor(extra / beta)
    most = 2 * extra - least
    if most >= context_len - window:
        most = context_len - window
        least = 2 * extra - most
    step = (most - least) // (num_layers - 1)
    return [window + most - layer * step for layer in range(num_layers)]


@dataclass(frozen=True)
class LayerPlan:
    """What a policy will keep at a budget for one prompt."""

    requested: int  # mean entries per layer the budget asked for
    effective: int  # after the policy's floor and the prompt length
    per_layer: list[int]
    context_len: int
    target_bytes: int | None = None  # a memory budget's bytes (the entries are what they buy)

    @property
    def compressed(self) -> bool:
        return any(n < self.context_len for n in self.per_layer)

    @property
    def mean(self) -> float:
        return sum(self.per_layer) / len(self.per_layer)


def plan(policy, budget: Budget, context_len: int, num_layers: int) -> LayerPlan:
    """Per-layer budgets for ``policy`` at ``budget`` on a prompt of ``context_len`` tokens."""
    requested = budget.entries(context_len)
    effective = min(max(requested, policy.min_budget), context_len)
    per_layer = policy.layer_budgets(effective, context_len, num_layers)
    return LayerPlan(requested=requested, effective=effective, per_layer=per_layer, context_len=context_len)


# --- memory: what a cache of some entries stores, and how many entries a memory budget buys -------------------------

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

    def full_bytes(self, context_len: int) -> int:
        """The full cache of ``context_len`` tokens at 16 bits per value: what memory fractions are of."""
        return 2 * self.layers * self.kv_heads * context_len * self.head_dim * SIXTEEN_BITS


@dataclass(frozen=True)
class KVFormat:
    """How a compressed cache stores its kept entries.

    ``native``: the model's own cache at its dtype (``bits`` is the dtype's width): today's cache, token for token.
    ``bits`` 16 (where the model computes wider): every entry in 16 bits, widened for attention. ``bits`` 8/4/2:
    KIVI — per head, the last ``residual`` kept entries in 16 bits, the ones before them as packed integers, keys per
    channel in groups of ``group`` tokens, values per token in groups of ``group`` channels, each group's scale and
    minimum in 16 bits (``pkvbench.quantize``)."""

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


def keeps_fixed_set(policy) -> bool:
    """Whether ``policy`` keeps the same entries whatever its budget (the full cache): no memory budget changes it."""
    length = 4 * max(policy.min_budget, 1) + 64
    return policy.layer_budgets(max(policy.min_budget, 1), length, 2) == policy.layer_budgets(length, length, 2)


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
    per_layer = policy.layer_budgets(floor, context_len, geometry.layers)
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
        return planned_bytes(fmt, policy.layer_budgets(k, context_len, geometry.layers), heads, geometry.head_dim)

    k = largest(min(max(policy.min_budget, 1), context_len), context_len, lambda k: cost(k) <= target)
    if k is None:
        needed = floor_bytes(policy, context_len, geometry, fmt, heads)
        raise MemoryTooSmall(budget, needed, full, f"{policy.label} at {fmt} bits on {context_len} tokens")
    per_layer = policy.layer_budgets(k, context_len, geometry.layers)
    return LayerPlan(requested=k, effective=k, per_layer=per_layer, context_len=context_len, target_bytes=target)


def parse_decode_budgets(value: Any) -> list[int | None]:
    """``--decode-budget 128,512`` (entries per KV head; ``none``: no cut while decoding) → each once, in order."""
    if value is None:
        return [None]
    parsed: list[int | None] = []
    for item in as_list(value, "--decode-budget"):
        if item.lower() == "none":
            parsed.append(None)
            continue
        try:
            number = int_text(item)
        except ValueError:
            number = 0
        if number < 1:
            raise PkvError(f"--decode-budget {item!r}: give entries per KV head (a positive integer) or none")
        parsed.append(number)
    return list(dict.fromkeys(parsed))
