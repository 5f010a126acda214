"""PyramidKV (Cai et al., 2024): SnapKV's selection with a pyramid of per-layer budgets.

Which entries a layer keeps is exactly SnapKV's rule. What changes is how many: lower layers, where attention is
spread wide, get more; higher layers, where it has funnelled onto a few tokens, get fewer. The budgets beyond the
window form an arithmetic sequence with the same total as a uniform split (see ``budgets.pyramid``).
"""

from dataclasses import dataclass

from pkvbench import budgets
from pkvbench.policies.snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    summary = "SnapKV selection; per-layer budgets an arithmetic sequence (beta 20), bottom layers largest"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"{self.name}: beta must be at least 1 (the top layer's share is (k-window)/beta)")

    def layer_budgets(self, k: int, context_len: int, num_layers: int) -> list[int]:
        return budgets.pyramid(k, context_len, num_layers, window=self.window, beta=self.beta)
