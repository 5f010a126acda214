"""Named parts that other packages can add: policies, task generators and metrics.

Each kind has a registry: its built-in entries as a dict of name → ``"module:attr"`` (in listing order), and those of
other installed packages, found through a Python entry point group (``pkvbench.policies``, ``pkvbench.tasks``,
``pkvbench.metrics.functions``) and listed after the built-ins, by name. Names are known without importing anything; an entry
is imported the first time it is asked for, so a broken plugin stops only what uses it, with one line that names it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import Any

from pkvbench.errors import PkvError, first_line


@cache
def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The installed packages' entry points of a group, by name."""
    return tuple(sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name))


def import_target(target: str, where: str) -> Any:
    """The object a ``"module:attr"`` target names; any failure becomes one line that starts with ``where``."""
    module, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except Exception as exc:  # a broken plugin must name itself, whatever it raised
        raise PkvError(f"{where} failed to load: {type(exc).__name__}: {first_line(exc)}") from None


class Registry(Mapping):
    """The entries of one kind by name: built-in ones, then plugins; each imported and checked on first access.

    ``check(name, entry, where)`` raises a PkvError starting with ``where`` when what was imported is not an entry
    of this kind. A plugin that takes a name already taken is refused when that name is asked for.
    """

    def __init__(self, kind: str, group: str, builtin: Mapping[str, str], check: Callable[[str, Any, str], None]):
        self.kind, self.group, self.builtin, self.check = kind, group, builtin, check
        self._loaded: dict[str, Any] = {}

    def names(self) -> list[str]:
        """Built-in names in their order, then the plugins' by name (a plugin reusing a built-in name is left out
        here and refused when the name is asked for)."""
        return list(self.builtin) + [e.name for e in entry_points(self.group) if e.name not in self.builtin]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(self.names()))

    def __len__(self) -> int:
        return len(dict.fromkeys(self.names()))

    def __contains__(self, name: object) -> bool:
        return name in self.builtin or any(e.name == name for e in entry_points(self.group))

    def __getitem__(self, name: str) -> Any:
        if name in self._loaded:
            return self._loaded[name]
        if name not in self:
            raise KeyError(name)
        claims = [(self.builtin[name], f"{self.kind} {name!r}")] if name in self.builtin else []
        claims += [
            (e.value, f"{self.kind} plugin {name!r} ({e.value})") for e in entry_points(self.group) if e.name == name
        ]
        if len(claims) > 1:
            raise PkvError(f"{claims[1][1]}: a {self.kind} named {name!r} exists already")
        target, where = claims[0]
        entry = import_target(target, where)
        self.check(name, entry, where)
        self._loaded[name] = entry
        return entry
