"""Budgets: parsing ``--budget`` values and splitting a budget over layers.

A value below 1 is a fraction of the prompt (k = round(f·T) entries per KV head per layer, on average); a value of 1
or more is an integer count of entries. The same functions back ``pkvbench budgets`` and the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pkvbench.errors import PkvError

# How a fraction of the prompt becomes whole entries: half-up (pkvbench), or Python's round (half to even), as the
# reference code's --max_capacity_prompts_ratio does.
ROUNDINGS = ("half-up", "half-even")


# kvpress's spelling of a budget: the compression ratio r, the fraction of the cache *removed*; kept entries are
# int(T·(1 − r)), truncated as kvpress's ScorerPress does. Written "cr0.25".
REMOVED_PREFIX = "cr"


@dataclass(frozen=True)
class Budget:
    """A requested budget, as the user gave it."""

    value: float | int
    rounding: str = field(default="half-up", compare=False)
    removed: bool = False  # value is kvpress's compression ratio: the fraction removed

    @classmethod
    def parse(cls, text: str) -> Budget:
        text = str(text).strip()
        if text.startswith(REMOVED_PREFIX):
            try:
                ratio = float(text[len(REMOVED_PREFIX) :])
            except ValueError:
                ratio = float("nan")
            if not 0 <= ratio < 1:
                raise PkvError(
                    f"budget {text!r}: a compression ratio (the fraction removed) is cr0 .. cr0.99, e.g. cr0.5"
                )
            return cls(ratio, removed=True)
        try:
            number = float(text)
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
        return isinstance(self.value, float) and not self.removed

    @property
    def recorded(self) -> float | int | str:
        """What a result row's ``budget`` holds: the number as given, or the ``cr…`` spelling."""
        return str(self) if self.removed else self.value

    def entries(self, context_len: int) -> int:
        """Mean entries per KV head per layer for a prompt of ``context_len`` tokens (before any policy floor)."""
        if self.removed:
            return max(1, int(context_len * (1 - self.value)))
        if self.is_fraction:
            exact = self.value * context_len
            return max(1, round(exact) if self.rounding == "half-even" else math.floor(exact + 0.5))
        return int(self.value)

    def __str__(self) -> str:
        if self.removed:
            return f"{REMOVED_PREFIX}{self.value:g}"
        return f"{self.value:g}" if self.is_fraction else str(self.value)


def budget_label(value: float | int | str) -> str:
    """How a budget value is written in keys and tables: ``128``, ``0.12``, ``cr0.5``."""
    return str(Budget.parse(value) if isinstance(value, str) else Budget(value))


def parse_budgets(values: list[str] | str, rounding: str = "half-up") -> list[Budget]:
    items = [str(v).strip() for v in (values.split(",") if isinstance(values, str) else values)]
    if not any(items):
        raise PkvError("--budget is empty; give one or more budgets, e.g. 128,0.12")
    if not all(items):
        raise PkvError(f"--budget {','.join(items)!r} has an empty item; remove the extra comma")
    return list(dict.fromkeys(replace(Budget.parse(item), rounding=rounding) for item in items))


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
