"""Policies: which KV entries to keep.

One file per rule (``full.py``, ``snapkv.py``, …), the shared selection in ``base.py``, the registry of names in
``registry.py`` and the ``name:opt=value`` parser in ``spec.py``. The names below are imported on first use, so
that reading the registry's order (``policy_order``) does not import torch.
"""

from __future__ import annotations

import importlib

from pkvbench.policies.registry import default_grid, policy_order, registry

_LAZY = {
    "LayerStats": "pkvbench.policies.base",
    "Needs": "pkvbench.policies.base",
    "Policy": "pkvbench.policies.base",
    "ScoringPolicy": "pkvbench.policies.base",
    "WindowedPolicy": "pkvbench.policies.base",
    "StatisticNotRecorded": "pkvbench.policies.base",
    "parse_policy": "pkvbench.policies.spec",
    "parse_option_pairs": "pkvbench.policies.spec",
    "check_shared_options": "pkvbench.policies.spec",
}
__all__ = ["default_grid", "policy_order", "registry", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pkvbench.policies' has no attribute {name!r}")
