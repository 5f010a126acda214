"""Policy specs: ``snapkv`` or ``snapkv:window=32:kernel=5`` → a policy object; ``--policy-arg`` options."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pkvbench.cell.schema import DEFAULT_PROTOCOL, PROTOCOLS
from pkvbench.config import as_list, excerpt, one_of, option_text, parse_float, parse_int
from pkvbench.errors import PkvError
from pkvbench.policies.base import Policy
from pkvbench.policies.registry import default_grid, registry


def parse_option_pairs(pairs: list[str]) -> dict[str, str]:
    """``["window=32", "beta=10"]`` → ``{"window": "32", "beta": "10"}``; an option given twice is refused (the
    last one would win without a word)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise PkvError(f"policy option {pair!r} is not of the form name=value (e.g. window=32)")
        if key.strip() in options:
            raise PkvError(
                f"policy option {key.strip()} is given twice ({key.strip()}={options[key.strip()]} and {pair.strip()})"
                "; give it once"
            )
        options[key.strip()] = value.strip()
    return options


# A policy's integer options are sizes, counts and seeds that reach torch as 64-bit integers: anything wider is
# refused when the option is parsed, not by torch after the model has loaded.
OPTION_INT_RANGE = (-(2**63), 2**63 - 1)


def _coerce(policy: str, option: str, kind: type, text: str) -> object:
    """An option's text as its field's type, by the one number parser (``config.parse_int`` / ``parse_float``)."""
    what = f"{policy}: option {option}"
    if kind is int:
        return parse_int(text, what, *OPTION_INT_RANGE)
    if kind is float:
        return parse_float(text, what)
    if kind is bool and text.lower() in ("true", "false", "1", "0", "yes", "no"):
        return text.lower() in ("true", "1", "yes")
    if kind is str:
        return text
    raise PkvError(f"{policy}: option {option}={excerpt(repr(text))} is not a valid {kind.__name__}")


def split_spec(spec: str) -> tuple[str, str | None, list[str]]:
    """``snapkv:window=32`` → (snapkv, None, [window=32]); ``adakv(snapkv:window=32):alpha=0.3`` → (adakv,
    snapkv:window=32, [alpha=0.3])."""
    spec = spec.strip()
    opening = spec.find("(")
    if opening < 0 or (":" in spec and spec.index(":") < opening):
        name, *own = [part.strip() for part in spec.split(":")]
        return name, None, own
    depth = 0
    for position in range(opening, len(spec)):
        depth += {"(": 1, ")": -1}.get(spec[position], 0)
        if depth == 0:
            break
    rest = spec[position + 1 :].strip()
    if depth or (rest and not rest.startswith(":")):
        raise PkvError(f"policy {spec!r}: write a wrapper as name(inner), options after it: adakv(snapkv):alpha=0.3")
    own = [part.strip() for part in rest[1:].split(":")] if rest else []
    return spec[:opening].strip(), spec[opening + 1 : position].strip(), own


def parse_policy(spec: str, shared_options: dict[str, str] | None = None, protocol: str = DEFAULT_PROTOCOL) -> Policy:
    """Build a policy from ``name[:opt=value...]``.

    ``shared_options`` (from ``--policy-arg``) apply to every policy that has such an option; options in the spec
    itself win over them. Under the ``reference`` protocol a policy starts from its ``reference_options`` (how the
    PyramidKV paper's code selects) instead of its defaults; options the user gives still win. Wrappers have no
    reference options, and their inner policy keeps its own defaults. Under ``kvpress`` a policy — a wrapper and its
    inner policy too — starts from its ``kvpress_options``: the settings of NVIDIA kvpress's press of the same rule
    where pkvbench's defaults differ on purpose (``docs/kvpress-crosscheck.md``).
    """
    one_of(PROTOCOLS)(protocol, "--protocol")  # as the option checks it (options.py), for callers of this function
    policies = registry()
    name, inner_spec, own = split_spec(spec)
    if name not in policies:
        raise PkvError(f"unknown policy {name!r}; valid policies: {', '.join(policies)}")
    cls = policies[name]
    wraps = getattr(cls, "wraps", False)
    if wraps != (inner_spec is not None):
        raise PkvError(
            f"policy {name} wraps another: write {name}(snapkv)"
            if wraps
            else f"policy {name} does not wrap another policy: {spec!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "inner"}
    own_options = parse_option_pairs(own)
    for option in own_options:
        if option not in fields:
            valid = ", ".join(fields) or "none"
            raise PkvError(f"policy {name} has no option {option!r}; its options: {valid}")
    merged = {k: v for k, v in (shared_options or {}).items() if k in fields} | own_options
    kwargs = {k: _coerce(name, k, type(fields[k].default), v) for k, v in merged.items()}
    if protocol == "reference":
        kwargs = {**cls.reference_options, **kwargs}
    elif protocol == "kvpress":
        kwargs = {**cls.kvpress_options, **kwargs}
    if wraps:
        # A wrapper (AdaKV, ChunkKV) is no rule of the paper's code: it and its inner policy select as pkvbench
        # does under the reference protocol (the reference's one set per query head would contradict the wrapper's
        # own per-KV-head choice); kvpress wraps its own presses, so there the inner policy takes kvpress's options.
        kwargs["inner"] = parse_policy(inner_spec, shared_options, "kvpress" if protocol == "kvpress" else "exact")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise PkvError(str(exc)) from None


def check_shared_options(shared_options: dict[str, str], policies: list[Policy]) -> None:
    """A ``--policy-arg`` that no requested policy takes is almost surely a typo: say so."""
    known = {f.name for p in policies for f in dataclasses.fields(p)}
    for option in shared_options:
        if option not in known:
            names = ", ".join(sorted({p.name for p in policies}))
            raise PkvError(f"--policy-arg {option}: none of the requested policies ({names}) has that option")


def parse_policies(
    specs: Any, policy_args: Mapping[str, Any] | Sequence[str] = (), protocol: str = DEFAULT_PROTOCOL
) -> list[Policy]:
    """Policy specs (``snapkv:window=32``) plus options shared by every policy that has them; each label once."""
    if isinstance(policy_args, Mapping):
        shared = {str(k): option_text(v) for k, v in policy_args.items()}
    else:
        shared = parse_option_pairs(list(policy_args))
    names = default_grid() if specs is None else as_list(specs, "--policy")
    policies = [parse_policy(spec, shared, protocol) for spec in names]
    check_shared_options(shared, policies)
    return list({p.label: p for p in policies}.values())
