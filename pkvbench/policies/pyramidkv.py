"""PyramidKV (Cai et al., 2024): SnapKV's selection with a pyramid of per-layer budgets.

Which entries a layer keeps is exactly SnapKV's rule. What changes is how many: lower layers, where attention is
spread wide, get more; higher layers, where it has funnelled onto a few tokens, get fewer. The budgets beyond the
window form an arithmetic sequence with the same total as a uniform split (``budgets=exact``, ``pyramid``)
or as the paper's code computes them (``budgets=reference``, ``pyramid_reference``: the step floored, so
more than L·k in all; uniform k when T < 2(k - window)).
"""

import math
from dataclasses import dataclass
from typing import ClassVar

from pkvbench.policies.snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    summary = "SnapKV selection; per-layer budgets an arithmetic sequence (beta 20), bottom layers largest"
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"budgets": ("exact", "reference")}
    reference_options: ClassVar[dict[str, object]] = {**SnapKV.reference_options, "budgets": "reference"}
    beta: float = 20.0
    budgets: str = "exact"

    def __post_init__(self) -> None:
        if self.beta < 1:  # before the base's check, whose "at least 0" would be the wrong bound for beta
            raise ValueError(f"{self.name}: beta must be at least 1 (the top layer's share is (k-window)/beta)")
        super().__post_init__()

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        rule = pyramid_reference if self.budgets == "reference" else pyramid
        return rule(k, context_len, num_layers, window=self.window, beta=self.beta)


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
