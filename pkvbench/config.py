"""Run configs: a YAML file of run options, read into ``RunConfig`` fields (``pkvbench run --config FILE``,
``RunConfig.from_file``).

Keys are ``pkvbench run``'s long options, with dashes or underscores (``max-length`` or ``max_length``), or the
``RunConfig`` field names (``tasks``, ``policies``, ``budgets``, ``policy_args``). List options take a YAML list or a
comma string; ``policy-arg`` takes a mapping or a list of ``name=value``; flags take true/false. On the command
line the file only sets defaults: any flag given there wins. An unknown key, a key given twice under two spellings
and a value of the wrong shape are errors that name the key; the values themselves are checked by the run, exactly
as if they had been typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from pkvbench.errors import PkvError
from pkvbench.io import read_text

FLAGS = {"overwrite", "quiet", "verify"}
LISTS = {
    "tasks",
    "policies",
    "budgets",
    "lengths",
    "depths",
    "sample_ids",
    "include_paths",
    "query_modes",
    "decode_budgets",
}
PAIRS = {"policy_args", "task_args"}
# Spellings other than the field's own name (and its dashed form).
ALIASES = {
    "task": "tasks",
    "policy": "policies",
    "budget": "budgets",
    "policy-arg": "policy_args",
    "task-arg": "task_args",
    "sample-id": "sample_ids",
    "include-path": "include_paths",
    "query-mode": "query_modes",
    "decode-budget": "decode_budgets",
}
NEGATED = {"no-verify": "verify", "no_verify": "verify"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice (plain YAML keeps the last one silently)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping); duplicate keys are refused."""
    text = read_text(path, what)
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None)
        raise PkvError(f"{what} {path}: not valid YAML{at}{f' ({problem})' if problem else ''}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PkvError(f"{what} {path}: expected a mapping of option: value at the top level")
    return raw


def _spellings(fields: Iterable[str]) -> dict[str, tuple[str, bool]]:
    """Every accepted key → (field, negated)."""
    names = {}
    for name in fields:
        names[name] = (name, False)
        names[name.replace("_", "-")] = (name, False)
    for alias, name in ALIASES.items():
        names[alias] = (name, False)
        names[alias.replace("-", "_")] = (name, False)
    for alias, name in NEGATED.items():
        names[alias] = (name, True)
    return names


def _value(key: str, field: str, value: Any) -> Any:
    if field in FLAGS:
        if not isinstance(value, bool):
            raise PkvError(f"config key {key!r}: expected true or false, got {value!r}")
        return value
    if field in PAIRS:
        items = value if isinstance(value, (list, dict)) else [value]
        if isinstance(items, list) and any(isinstance(i, (list, dict)) for i in items):
            raise PkvError(f"config key {key!r}: list items must be single values (name=value)")
        return {str(k): v for k, v in items.items()} if isinstance(items, dict) else [str(i) for i in items]
    if isinstance(value, dict):
        raise PkvError(f"config key {key!r}: expected a value{' or a list' if field in LISTS else ''}, got a mapping")
    if isinstance(value, list):
        if field not in LISTS:
            raise PkvError(f"config key {key!r}: expected a single value, got a list")
        if not value:
            raise PkvError(f"config key {key!r}: the list is empty")
        if any(isinstance(i, (list, dict)) for i in value):
            raise PkvError(f"config key {key!r}: list items must be single values, got {value!r}")
    return value


def read_run_config(path: str | Path, fields: Iterable[str]) -> dict[str, Any]:
    """Read ``path`` into ``{field: value}`` for the given config fields (empty values are left out)."""
    spellings = _spellings(fields)
    result: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in load_yaml_mapping(path).items():
        key_text = str(key)
        if key_text not in spellings:
            valid = sorted({k for k in spellings if "_" not in k})
            raise PkvError(f"config {path}: unknown key {key_text!r}; valid keys: {', '.join(valid)}")
        field, negated = spellings[key_text]
        if field in seen:
            raise PkvError(f"config {path}: keys {seen[field]!r} and {key_text!r} set the same option")
        seen[field] = key_text
        if value is None:
            continue  # an empty value leaves the option at its default
        value = _value(key_text, field, value)
        result[field] = (not value) if negated else value
    return result
