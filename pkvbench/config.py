"""Run configs: a YAML file of run options, read into ``RunConfig`` fields (``pkvbench run --config FILE``,
``RunConfig.from_file``).

Keys are ``pkvbench run``'s long options, with dashes or underscores (``max-length`` or ``max_length``), or the
``RunConfig`` field names (``tasks``, ``policies``, ``budgets``, ``policy_args``), as each field's ``Option`` (the
end of this module; ``options.py``) declares them; ``html`` sets the command's
``--html`` (not a ``RunConfig`` field). List options take a YAML list or a comma string (``include-path`` too);
``policy-arg`` takes a mapping or a list of ``name=value``; flags take true/false. On the command
line the file only sets defaults: any flag given there wins. An unknown key, a key given twice under two spellings
and a value of the wrong shape are errors that name the key; the values themselves are checked by the run, exactly
as if they had been typed.

The YAML is read by ``io.parse_yaml``: numbers in plain decimal digits only (YAML 1.1's ``1_6``, ``0x10``, ``1:30``
stay text, ``010`` is ten), aliases up to ``io.ALIAS_EXPANSION_LIMIT`` values in all. A value a message echoes is cut
to a short excerpt (``shown``).

The numbers and flags of every option — typed on the command line, read from a config, or given to the Python API —
are parsed here, by ``parse_int``, ``parse_float`` and ``parse_bool``: an integer option takes an integer (never
1.7 cut to 1, never true as 1), a number is finite, and a bound is checked with the same words everywhere. Lists,
paths and ``name=value`` pairs too (``as_list`` and each field's ``Option.check``, which ``api.checked`` applies); what a policy, budget
or task setting means is parsed beside it (``policies/spec.py``, ``budgets.py``, ``tasks/registry.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError
from pkvbench.io import read_yaml

# --- numbers and flags -------------------------------------------------------------------------------------------

# Bounds nothing sensible lies beyond (a 10-million-layer budget table took 2.5 GB and 21 s to refuse).
SEED_MAX = 2**32 - 1  # numpy's and most generators' seed range
MAX_LAYERS = 4096
MIN_POWER = 0.01  # points: a smaller difference needs more samples than can be counted

# The one spelling of numbers: ASCII digits, no "_" separators. Python's int() and float() also read "1_6" and
# full-width digits ("１６"); a config's YAML reads neither as a number (``io._StrictLoader``), so neither does any
# other path in: the command line, a config and the Python API take the same numbers.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)

EXCERPT = 60  # characters of a value a message echoes: enough to recognise it, never megabytes


def excerpt(text: str, limit: int = EXCERPT) -> str:
    """``text`` as one short line for a message: line breaks shown as ``\\n``, cut to ``limit`` characters."""
    line = text.replace("\r", "\\r").replace("\n", "\\n")
    return line if len(line) <= limit else f"{line[: limit - 1]}…"


def shown(value: Any) -> str:
    """A value as a user wrote it, for messages: text as it is, flags as true/false; one line of at most
    ``EXCERPT`` characters (a config's value can be a megabyte)."""
    if isinstance(value, bool):
        return str(value).lower()
    return excerpt(value if isinstance(value, str) else _SHORT_REPR.repr(value))


def _short_repr() -> reprlib.Repr:
    """repr that walks a few items of a few levels only: a value may be a list of a million items."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, EXCERPT, EXCERPT
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    return short


_SHORT_REPR = _short_repr()


def int_text(text: str) -> int:
    """``int(text)`` for the one spelling of integers (``_INTEGER``); ValueError for any other."""
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(f"not an integer: {text!r}")
    return int(text.strip())


def float_text(text: str) -> float:
    """``float(text)`` for the one spelling of numbers (``_DECIMAL``); ValueError for any other."""
    if not _DECIMAL.fullmatch(text.strip()):
        raise ValueError(f"not a number: {text!r}")
    return float(text.strip())


def _number_text(number: int | float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def _bounded(number: int | float, what: str, value: Any, minimum, maximum, above=None) -> None:
    if above is not None and not number > above:
        raise PkvError(f"{what} {shown(value)}: must be more than {_number_text(above)}")
    if minimum is not None and number < minimum:
        raise PkvError(f"{what} {shown(value)}: must be at least {_number_text(minimum)}")
    if maximum is not None and number > maximum:
        raise PkvError(f"{what} {shown(value)}: must be at most {_number_text(maximum)}")


def parse_int(value: Any, what: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer option: an int, or text of one (``"12"``); a number with a fraction, a flag or anything else is
    refused, not cut."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PkvError(f"{what} {shown(value)}: expected an integer")
    if isinstance(value, str):
        if not _INTEGER.fullmatch(value.strip()):
            raise PkvError(f"{what} {shown(value)}: expected an integer")
        try:
            number = int_text(value)
        except ValueError:  # more digits than Python converts
            raise PkvError(f"{what}: {len(value.strip())} digits is not a usable integer") from None
    else:
        number = value
    _bounded(number, what, value, minimum, maximum)
    return number


def parse_float(
    value: Any, what: str, minimum: float | None = None, maximum: float | None = None, above: float | None = None
) -> float:
    """A number option: an int, a float or text of one, finite; ``above`` is an exclusive lower bound."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PkvError(f"{what} {shown(value)}: expected a number")
    try:
        number = float_text(value) if isinstance(value, str) else float(value)
    except ValueError:
        raise PkvError(f"{what} {shown(value)}: expected a number") from None
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise PkvError(f"{what} {shown(value)}: expected a finite number")
    _bounded(number, what, value, minimum, maximum, above)
    return number + 0.0  # -0.0 is 0.0: one number, one spelling


def parse_bool(value: Any, what: str) -> bool:
    """A flag: true or false (a string such as "false" is not a flag, and would read as true)."""
    if not isinstance(value, bool):
        raise PkvError(f"{what} {shown(value)}: expected true or false")
    return value


def option_text(value: Any) -> str:
    """An option's value as policy labels and ``--policy-arg`` write it: booleans lower-case (``true``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_yaml_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping); duplicate keys are refused."""
    raw = read_yaml(path, what)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PkvError(f"{what} {path}: expected a mapping of option: value at the top level")
    return raw


def _spellings(options: Mapping[str, Option]) -> dict[str, tuple[str, bool]]:
    """Every accepted key → (field, negated): the field's name and its flag's, with dashes or underscores; a flag
    spelled ``--no-NAME`` sets its field to the opposite."""
    names = {}
    for name, declared in options.items():
        for key in (name, declared.flag[2:]):
            negated = key != name and declared.flag.startswith("--no-")
            names.update(dict.fromkeys({key, key.replace("_", "-"), key.replace("-", "_")}, (name, negated)))
    return names


def _value(key: str, declared: Option, value: Any) -> Any:
    if declared.kind == FLAG:
        if not isinstance(value, bool):
            raise PkvError(f"config key {key!r}: expected true or false, got {shown(value)}")
        return value
    if declared.kind == PAIR:
        items = value if isinstance(value, (list, dict)) else [value]
        if isinstance(items, list) and any(isinstance(i, (list, dict)) for i in items):
            raise PkvError(f"config key {key!r}: list items must be single values (name=value)")
        return {str(k): v for k, v in items.items()} if isinstance(items, dict) else [str(i) for i in items]
    listed = declared.kind in (LIST, REPEATED)
    if isinstance(value, dict):
        raise PkvError(f"config key {key!r}: expected a value{' or a list' if listed else ''}, got a mapping")
    if isinstance(value, list):
        if not listed:
            raise PkvError(f"config key {key!r}: expected a single value, got a list")
        if not value:
            raise PkvError(f"config key {key!r}: the list is empty")
        if any(isinstance(i, (list, dict)) for i in value):
            raise PkvError(f"config key {key!r}: list items must be single values, got {shown(value)}")
    return value


def read_run_config(path: str | Path, options: Mapping[str, Option]) -> dict[str, Any]:
    """Read ``path`` into ``{field: value}`` for the given options (``options_of``; empty values are left out)."""
    spellings = _spellings(options)
    result: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in load_yaml_mapping(path).items():
        key_text = str(key)
        if key_text not in spellings:
            valid = sorted({k for k in spellings if "_" not in k})
            raise PkvError(f"config {path}: unknown key {excerpt(repr(key_text))}; valid keys: {', '.join(valid)}")
        field, negated = spellings[key_text]
        if field in seen:
            raise PkvError(f"config {path}: keys {seen[field]!r} and {key_text!r} set the same option")
        seen[field] = key_text
        if value is None:
            continue  # an empty value leaves the option at its default
        value = _value(key_text, options[field], value)
        result[field] = (not value) if negated else value
    return result


# --- lists, paths and option pairs ----------------------------------------------------------------------------------


def as_list(value: Any, what: str) -> list[str]:
    """A comma string or a sequence → a list of non-empty strings; an empty list or item is an error."""
    items = str(value).split(",") if isinstance(value, (str, int, float)) else [str(v) for v in value]
    items = [item.strip() for item in items]
    if not any(items):
        raise PkvError(f"{what} is empty; give a comma-separated list")
    if not all(items):
        raise PkvError(f"{what} {excerpt(repr(','.join(items)))} has an empty item; remove the extra comma")
    return items


def parse_numbers(value: Any, what: str, kind: type) -> tuple | None:
    """``--lengths`` / ``--depths``: positive integers or non-negative numbers, each once, in the order given (``-0``
    and ``0`` are one depth)."""
    if value is None:
        return None
    if kind is int:
        values = [parse_int(item, what, minimum=1) for item in as_list(value, what)]
    else:
        values = [parse_float(item, what, minimum=0) for item in as_list(value, what)]
    return tuple(dict.fromkeys(values))


# Checks of one configuration field each (``Option.check``): a ``RunConfig`` or ``FunnelConfig`` built in Python gets
# the checks the command line gives. A wrong type is one ``PkvError`` naming the option, never a TypeError from deep
# inside.

Check = Callable[[Any, str], Any]


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A number option's check: an integer (``kind`` int) or a finite number, within the bounds (``above``:
    exclusive). The command line parses with it too (``cli.Number``)."""

    kind: type = int
    minimum: int | float | None = None
    maximum: int | float | None = None
    above: float | None = None

    def __call__(self, value: Any, what: str) -> int | float:
        if self.kind is int:
            return parse_int(value, what, self.minimum, self.maximum)
        return parse_float(value, what, self.minimum, self.maximum, self.above)


def whole(minimum: int | None = None, maximum: int | None = None) -> Bounds:
    return Bounds(int, minimum, maximum)


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None) -> Bounds:
    return Bounds(float, minimum, maximum, above)


def name_value(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PkvError(f"{what}: expected a name, got {shown(value)}")
    return value


def path_value(value: Any, what: str) -> str:
    """A path, as text (a ``pathlib.Path`` too: what a run records must be JSON)."""
    if not isinstance(value, (str, os.PathLike)):
        raise PkvError(f"{what}: expected a path, got {shown(value)}")
    if not os.fspath(value).strip():
        raise PkvError(f"{what} '': an empty path would mean the current folder; give a name")
    return os.fspath(value)


def one_of(choices: Sequence[str]) -> Check:
    def check(value: Any, what: str) -> str:
        if value not in choices:
            raise PkvError(f"{what} {shown(value)}: valid: {', '.join(choices)}")
        return value

    return check


def one_each_of(choices: Sequence[str]) -> Check:
    """A list option whose items are each one of ``choices``: the items, each once, in the order given."""
    item_check = one_of(choices)

    def check(value: Any, what: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(item_check(item, what) for item in as_list(list_value(value, what), what)))

    return check


def _single(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def list_value(value: Any, what: str) -> Any:
    """A list option: a comma string, one number, or a list of single values."""
    if _single(value) or (isinstance(value, (list, tuple)) and all(_single(item) for item in value)):
        return value
    raise PkvError(f"{what}: expected a comma string or a list of values, got {shown(value)}")


def numbers(kind: type) -> Check:
    """``--lengths`` / ``--depths``: a list option of numbers, parsed (``parse_numbers``)."""

    def check(value: Any, what: str) -> tuple:
        return parse_numbers(list_value(value, what), what, kind)

    return check


def names(value: Any, what: str) -> tuple[str, ...]:
    """A list option of names (``--sample-id``), parsed: each non-empty, in the order given."""
    return tuple(as_list(list_value(value, what), what))


def path_list(value: Any, what: str) -> tuple[str, ...]:
    """Folders: a list of paths, or one comma string (``"a,b"``; one path is one folder, not its characters)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise PkvError(f"{what}: expected a list of folders or a comma string, got {shown(value)}")
    return tuple(os.fspath(path_value(item.strip() if isinstance(item, str) else item, what)) for item in items)


def pair_values(value: Any, what: str) -> Mapping[str, Any] | list[str]:
    """Options as a mapping or a list of ``name=value`` (one string: one pair)."""
    if isinstance(value, Mapping):
        return value
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items):
        return list(items)
    raise PkvError(f"{what}: expected a mapping or a list of name=value, got {shown(value)}")


# --- options: each declared once, as a configuration field's metadata -----------------------------------------------

# How an option takes its value: a comma list (or a YAML list), a repeatable value (a YAML list too), repeatable
# ``name=value`` pairs (or a mapping), a flag (true/false), or one value.
LIST, REPEATED, PAIR, FLAG, SCALAR = "list", "repeated", "pair", "flag", "scalar"
OPTION = "pkvbench.option"  # the key of a field's metadata that holds its Option

# Where a field goes besides its command line option (``Option.roles``), so that no table spells the field set again:
RECORDED = "recorded"  # run.json's / funnel.json's options: what makes two runs the same run (``api.recorded``)
TASK = "task"  # a ``TaskOptions`` field of the same name: how the samples are chosen (``api.task_options``)
SETTING = "setting"  # a ``RunSettings`` field: how every sample is run, by any executor (``options.RunSettings``)
MODEL = "model"  # how the model loads: ``load_model``'s keyword of the same name (``options.model_settings``)
MODEL_ARG = "model_arg"  # a model arg of lm-eval's ``pkvbench`` backend and an option of ``pkvbench lm-eval``


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of ``pkvbench run`` / ``funnel``, as its configuration field declares it (``option``): the Python
    API checks with it (``api.checked``), a config file reads its spellings from it (``read_run_config``) and the
    command line builds its flag from it (``cli.config_option``)."""

    default: Any
    help: str
    check: Check
    flag: str = ""  # the command line's; "" until ``options_of`` fills in the field's name, dashed
    kind: str = SCALAR
    choices: tuple[str, ...] | None = None  # the command line offers only these
    show_default: str | None = None  # words for a default the value does not say (None: shown when there is one)
    implied: Any = None  # the value a None takes once the option it shapes is given (``api.with_dependent_options``)
    roles: frozenset[str] = frozenset()  # where else the field goes (RECORDED, TASK, SETTING, MODEL, MODEL_ARG)
    name: str = ""  # the field's

    def parse(self, value: Any) -> Any:
        """``value`` checked; None stays None where it is the default."""
        return None if value is None and self.default is None else self.check(value, self.flag)


def option(
    default: Any,
    *,
    help: str = "",
    check: Check | None = None,
    choices: Sequence[str] | None = None,
    roles: Sequence[str] = (),
    **more,
) -> Any:
    """A configuration field declared with everything an option is (``Option``); ``check`` defaults to one of
    ``choices``."""
    choices = tuple(choices) if choices is not None else None
    check = check or one_of(choices)
    declared = Option(default, help, check, choices=choices, roles=frozenset(roles), **more)
    return dataclasses.field(default=default, metadata={OPTION: declared})


@functools.cache
def options_of(config: type) -> dict[str, Option]:
    """Every option of a configuration class, by field name, in the fields' order, with its name and flag."""
    return {
        f.name: dataclasses.replace(declared, name=f.name, flag=declared.flag or "--" + f.name.replace("_", "-"))
        for f in dataclasses.fields(config)
        if (declared := f.metadata.get(OPTION)) is not None
    }


def options_with(config: type, role: str) -> list[Option]:
    """The options of a configuration class that go where ``role`` says, in the fields' order."""
    return [declared for declared in options_of(config).values() if role in declared.roles]
