"""The policy registry: the one list that the CLI's defaults, report order, ``pkvbench list`` and the contract tests
derive from.

Built-in policies come first, in the order below; policies of other packages follow, registered through the Python
entry point group ``pkvbench.policies`` (name = the policy's ``name``, value = ``module:Class``)::

    [project.entry-points."pkvbench.policies"]
    lastnorm = "my_package.policies:LastNorm"

Names are known without importing anything (so ``pkvbench report`` can order its rows without torch); the classes
are imported on first use (``pkvbench.plugins``, shared with the task generators' and metrics' registries).
"""

from __future__ import annotations

from functools import cache

from pkvbench.errors import PkvError
from pkvbench.plugins import Registry

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


def _check_policy_class(name: str, cls, where: str) -> None:
    from pkvbench.policies.base import Policy

    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PkvError(f"{where} is not a pkvbench.policies.Policy subclass")
    if getattr(cls, "name", None) != name:
        raise PkvError(f"{where}: the class's name is {getattr(cls, 'name', None)!r}, the entry point's {name!r}")


POLICIES = Registry("policy", ENTRY_POINT_GROUP, BUILTIN, _check_policy_class)


def policy_order() -> list[str]:
    """Every policy name: built-in ones in their order, then plugins by name (how reports sort their rows)."""
    return POLICIES.names()


@cache
def registry() -> dict:
    """Every policy class by name, in ``policy_order``."""
    return {name: POLICIES[name] for name in POLICIES}


def default_grid() -> list[str]:
    """The policies ``pkvbench run`` runs when none are named: the full cache and the paper's four."""
    return [name for name, cls in registry().items() if cls.in_default_grid]
