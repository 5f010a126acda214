"""Budgets: parsing ``--budget``, ``--memory`` and ``--decode-budget`` values, and a policy's plan at a budget.

A value below 1 is a fraction of the prompt (k = round(f·T) entries per KV head per layer, on average); a value of 1
or more is an integer count of entries. The same functions back ``pkvbench budgets`` and the engine.

A budget may also be memory (``--memory``, written ``mem0.05`` or ``mem2MiB`` in rows): bytes rather than entries.
How many bytes a cache of some entries takes in a storage format, and so how many entries a memory budget buys, is
``kv_formats.py``'s. How a budget splits over layers is each policy's (``layer_budgets``: uniform here, PyramidKV's
pyramid in ``policies/pyramidkv.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
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
# The budget a grid takes when none is given: 128 entries per KV head per layer; with a decode budget, nothing cut at
# the prefill (kvpress's ratio 0), so that the cuts while decoding are all that is measured.
DEFAULT_BUDGET = "128"
DEFAULT_DECODING_BUDGET = f"{REMOVED_PREFIX}0"
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


def rounding_for(protocol: str) -> str:
    """How fractions of the prompt round to entries under a protocol: the reference code rounds half to even."""
    return "half-even" if protocol == "reference" else "half-up"


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


def layer_budgets(policy, k: int, context_len: int, num_layers: int, local: Sequence[int | None] = ()) -> list[int]:
    """``policy``'s per-layer budgets at k. A mixed model's local (sliding) layer — ``local[i]``, its reach: the
    entries its window can still see, ``engine/architecture.py`` — keeps the last min(context_len, reach) entries
    whatever the budget; the policy splits k over the other layers."""
    locals_ = sum(reach is not None for reach in local)
    if not locals_:
        return policy.layer_budgets(k, context_len, num_layers)
    compressed = iter(policy.layer_budgets(k, context_len, num_layers - locals_) if locals_ < num_layers else ())
    return [min(context_len, reach) if reach is not None else next(compressed) for reach in local]


def plan(policy, budget: Budget, context_len: int, num_layers: int, local: Sequence[int | None] = ()) -> LayerPlan:
    """Per-layer budgets for ``policy`` at ``budget`` on a prompt of ``context_len`` tokens (``local``: the local
    layers' reach, see ``layer_budgets``)."""
    requested = budget.entries(context_len)
    effective = min(max(requested, policy.min_budget), context_len)
    per_layer = layer_budgets(policy, effective, context_len, num_layers, local)
    return LayerPlan(requested=requested, effective=effective, per_layer=per_layer, context_len=context_len)


def keeps_fixed_set(policy) -> bool:
    """Whether ``policy`` keeps the same entries whatever its budget (the full cache): no memory budget changes it."""
    length = 4 * max(policy.min_budget, 1) + 64
    return policy.layer_budgets(max(policy.min_budget, 1), length, 2) == policy.layer_budgets(length, length, 2)


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
