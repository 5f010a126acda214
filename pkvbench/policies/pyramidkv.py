"""PyramidKV (Cai et al., 2024): SnapKV's selection with a pyramid of per-layer budgets.

Which entries a layer keeps is exactly SnapKV's rule. What changes is how many: lower layers, where attention is
spread wide, get more; higher layers, where it has funnelled onto a few tokens, get fewer. The budgets beyond the
window form an arithmetic sequence with the same total as a uniform split (``budgets=exact``, ``budgets.pyramid``)
or as the paper's code computes them (``budgets=reference``, ``budgets.pyramid_reference``: the step floored, so
more than L·k in all; uniform k when T < 2(k - window)).
"""

from dataclasses import dataclass
from typing import ClassVar

from pkvbench import budgets as budget_rules
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
        rule = budget_rules.pyramid_reference if self.budgets == "reference" else budget_rules.pyramid
        return rule(k, context_len, num_layers, window=self.window, beta=self.beta)
