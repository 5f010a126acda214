"""The policy registry: the one list that the CLI's defaults, report order, ``pkvbench list`` and the contract tests
derive from.

Built-in policies come first, in the order below; policies of other packages follow, registered through the Python
entry point group ``pkvbench.policies`` (name = the policy's ``name``, value = ``module:Class``)::

    [project.entry-points."pkvbench.policies"]
    lastnorm = "my_package.policies:LastNorm"

Names are known without importing anything (so ``pkvbench report`` can order its rows without torch); the classes
are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from functools import cache

from pkvbench.errors import PkvError, first_line

ENTRY_POINT_GROUP = "pkvbench.policies"
# name → where its class lives, in report order.
BUILTIN: dict[str, str] = {
    "full": "pkvbench.policies.full:FullCache",
    "streamingllm": "pkvbench.policies.streamingllm:StreamingLLM",
    "h2o": "pkvbench.policies.h2o:H2O",
    "snapkv": "pkvbench.policies.snapkv:SnapKV",
    "pyramidkv": "pkvbench.policies.pyramidkv:PyramidKV",
    "random": "pkvbench.policies.random:Random",
    "knorm": "pkvbench.policies.knorm:Knorm",
    "keydiff": "pkvbench.policies.keydiff:KeyDiff",
    "tova": "pkvbench.policies.tova:TOVA",
    "rkv": "pkvbench.policies.rkv:RKV",
    "expected_attention": "pkvbench.policies.expected_attention:ExpectedAttention",
    "kvzip": "pkvbench.policies.kvzip:KVzip",
    "adakv": "pkvbench.policies.adakv:AdaKV",
    "chunkkv": "pkvbench.policies.chunkkv:ChunkKV",
}


@cache
def _plugins() -> tuple[importlib.metadata.EntryPoint, ...]:
    return tuple(sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name))


def policy_order() -> list[str]:
    """Every policy name: built-in ones in their order, then plugins by name (how reports sort their rows)."""
    return list(BUILTIN) + [e.name for e in _plugins() if e.name not in BUILTIN]


def _load(name: str, target: str, where: str):
    from pkvbench.policies.base import Policy

    module, _, attribute = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except Exception as exc:  # a broken plugin must name itself, whatever it raised
        raise PkvError(f"{where} failed to load: {type(exc).__name__}: {first_line(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PkvError(f"{where} is not a pkvbench.policies.Policy subclass")
    if getattr(cls, "name", None) != name:
        raise PkvError(f"{where}: the class's name is {getattr(cls, 'name', None)!r}, the entry point's {name!r}")
    return cls


@cache
def registry() -> dict:
    """Every policy class by name, in ``policy_order``."""
    policies = {name: _load(name, target, f"policy {name!r}") for name, target in BUILTIN.items()}
    for entry in _plugins():
        where = f"policy plugin {entry.name!r} ({entry.value})"
        if entry.name in policies:
            raise PkvError(f"{where}: a policy named {entry.name!r} exists already")
        policies[entry.name] = _load(entry.name, entry.value, where)
    return policies


def default_grid() -> list[str]:
    """The policies ``pkvbench run`` runs when none are named: the full cache and the paper's four."""
    return [name for name, cls in registry().items() if cls.in_default_grid]
