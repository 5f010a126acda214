"""Run configs: a YAML file of ``pkvbench run`` options (``pkvbench run --config FILE``).

Keys are the command's long options, with dashes or underscores (``max-length`` or ``max_length``), plus the plural
aliases ``tasks``, ``policies``, ``budgets``. Comma-list options take a YAML list or a comma string; ``policy-arg``
takes a list of ``name=value`` or a mapping; flags take true/false. The file only sets defaults: any flag given on
the command line wins. An unknown key is an error that names it; values are checked by the command itself, exactly
as if they had been typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from pkvbench.errors import PkvError

ALIASES = {"tasks": "task", "policies": "policy", "budgets": "budget"}
NOT_IN_CONFIG = {"config", "help"}


def option_names(command: click.Command) -> dict[str, click.Option]:
    """Every spelling a config may use for each of ``command``'s options → that option."""
    names: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in NOT_IN_CONFIG:
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                names[opt[2:]] = param
                names[opt[2:].replace("-", "_")] = param
        names[param.name] = param
    for alias, target in ALIASES.items():
        if target in names:
            names[alias] = names[target]
    return names


def _as_list_text(key: str, value: Any) -> str:
    if isinstance(value, (list, tuple)):
        if not value:
            raise PkvError(f"config key {key!r}: the list is empty")
        for item in value:
            if isinstance(item, (list, dict)):
                raise PkvError(f"config key {key!r}: list items must be single values, got {item!r}")
        return ",".join(_scalar_text(v) for v in value)
    if isinstance(value, dict):
        raise PkvError(f"config key {key!r}: expected a value or a list, got a mapping")
    return _scalar_text(value)


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _convert(key: str, param: click.Option, value: Any) -> Any:
    if param.is_flag:
        if not isinstance(value, bool):
            raise PkvError(f"config key {key!r}: expected true or false, got {value!r}")
        return value
    if param.multiple:
        if isinstance(value, dict):
            items = [f"{k}={_scalar_text(v)}" for k, v in value.items()]
        else:
            items = list(value) if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, (list, dict)):
                raise PkvError(f"config key {key!r}: list items must be single values (name=value), got {item!r}")
        return tuple(_scalar_text(item) for item in items)
    return _as_list_text(key, value)


def load_run_config(path: str | Path, command: click.Command) -> dict[str, Any]:
    """Read ``path`` and return a Click ``default_map`` for ``command`` (parameter name → value)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PkvError(f"config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PkvError(f"config {path}: cannot read it ({exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise PkvError(f"config {path}: not valid YAML{at}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PkvError(f"config {path}: expected a mapping of option: value at the top level")
    names = option_names(command)
    result: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in raw.items():
        key_text = str(key)
        if key_text not in names:
            valid = sorted({p.opts[0][2:] for p in names.values()})
            raise PkvError(f"config {path}: unknown key {key_text!r}; valid keys: {', '.join(valid)}")
        param = names[key_text]
        if param.name in seen:
            raise PkvError(f"config {path}: keys {seen[param.name]!r} and {key_text!r} set the same option")
        seen[param.name] = key_text
        if value is None:
            continue  # an empty value leaves the option at its default
        result[param.name] = _convert(key_text, param, value)
    return result
