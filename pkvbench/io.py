"""Files: JSON-lines reading, atomic rewrites, and turning the operating system's errors into one line.

Every file pkvbench rewrites (``run.json``, ``summary.csv``, reports) goes through ``atomic_write``: the new content is
written beside the target, synced, and renamed over it, so a kill or a full disk at any moment leaves either the old
version or the new one, never a truncated file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pkvbench.errors import PkvError


def os_error(path: str | os.PathLike, exc: OSError, doing: str = "write") -> PkvError:
    """One line naming the path and the reason (disk full, permission denied, not a folder, ...)."""
    reason = exc.strerror or type(exc).__name__
    return PkvError(f"cannot {doing} {path}: {reason}")


def make_dir(path: str | os.PathLike, what: str = "folder") -> bool:
    """Create the folder ``path`` and its parents if missing; returns whether it was created here. A file in the way,
    a missing permission or a full disk is one line naming the path."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.exists():
        raise PkvError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True)
    except FileExistsError:  # made meanwhile by another process, or a file took the name
        if path.is_dir():
            return False
        raise PkvError(f"{what} {path} is a file, not a folder") from None
    except OSError as exc:
        raise os_error(path, exc, "create") from None
    return True


def remove_file(path: str | os.PathLike) -> None:
    """Delete the file ``path`` if it is there (one line if it cannot be)."""
    _remove(os.unlink, path)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete the folder ``path`` and everything in it if it is there (one line if it cannot be)."""
    _remove(shutil.rmtree, path)


def _remove(remove: Callable[[Any], None], path: str | os.PathLike) -> None:
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise os_error(exc.filename or path, exc, "delete") from None


# The process's umask, read once at import (reading it means setting it, which is not safe once threads run).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _new_file_mode(path: Path) -> int:
    """The permissions a replaced file keeps, or those ``open`` would give a new one (mkstemp's are owner-only)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_UMASK


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` all at once (text is written as UTF-8)."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise os_error(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), _new_file_mode(path))
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise os_error(path, exc) from None


def is_staging_file(name: str, target: str) -> bool:
    """Whether the file ``name`` is one ``atomic_write`` stages ``target`` in (one is left behind only by a kill)."""
    return name.startswith(f".{target}.") and name.endswith(".tmp")


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PkvError(f"{what} {path} is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise os_error(path, exc, "read") from None


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PkvError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def parse_json_lines(
    text: str, where: str, *, partial_tail: bool = False, check: Callable[[dict[str, Any], str], None] | None = None
) -> list[dict[str, Any]]:
    """One JSON object per non-empty line. With ``partial_tail``, a last line without its newline (a run killed
    mid-write) is not a result and is left out; any other bad line is an error naming ``where`` and the line.
    ``check(row, "where, line N")`` may refuse a row by raising."""
    lines = text.split("\n")
    if partial_tail and lines and lines[-1] != "":
        lines = lines[:-1]
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PkvError(f"{where}, line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise PkvError(f"{where}, line {number}: expected a JSON object, got {type(row).__name__}")
        if check is not None:
            check(row, f"{where}, line {number}")
        rows.append(row)
    return rows


def read_json_lines(
    path: str | os.PathLike,
    what: str = "file",
    *,
    partial_tail: bool = False,
    check: Callable[[dict[str, Any], str], None] | None = None,
) -> list[dict[str, Any]]:
    return parse_json_lines(read_text(path, what), str(path), partial_tail=partial_tail, check=check)


# --- YAML --------------------------------------------------------------------------------------------------------


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML as people mean it: a key given twice is refused (plain YAML keeps the last one silently), and a key must
    be a plain value (a list or mapping as a key is legal YAML that no option can mean). Parsed by LibYAML where
    PyYAML was built with it: the built-in task files read ~10x faster, on every run's start."""


def _strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain name, not a list or a mapping", key_node.start_mark
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)

# Numbers as the command line reads them (``config.parse_int`` / ``parse_float``): plain decimal digits. YAML 1.1, which
# PyYAML implements, also reads 1_6 as 16, 010 as 8, 0x10 as 16 and 1:30 as 90, none of which the command line takes:
# such text stays text here, and the option's parser refuses it in one line.
_NUMBERS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in _NUMBERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))


def _decimal(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """An integer in decimal, as the command line reads it: 010 is ten, not YAML 1.1's octal eight."""
    text = loader.construct_scalar(node)
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a decimal integer", node.start_mark)
    return int(text)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _decimal)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)

# Aliases (``*name``) may repeat what an anchor holds, but not past this many values in all: a dozen lines of nested
# aliases can stand for 10^12 values (the "billion laughs"), which no option needs and every check would walk.
ALIAS_EXPANSION_LIMIT = 10_000


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes the document holds once every alias is expanded, stopping past ``ALIAS_EXPANSION_LIMIT``."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise PkvError("an alias refers to the value that holds it")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > ALIAS_EXPANSION_LIMIT:
                break
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    return size(root)


def _load(text: str) -> Any:
    """``yaml.load`` with ``_StrictLoader``, refusing a document whose aliases expand past the limit (checked on the
    composed nodes, before any value is built)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if "*" in text:  # no alias without one; a plain document skips the walk
            nodes = _expanded_size(node)
            if nodes > ALIAS_EXPANSION_LIMIT:
                raise PkvError(
                    f"its aliases (*name) expand to more than {ALIAS_EXPANSION_LIMIT} values; "
                    "write the values out, or use fewer aliases"
                )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> Any:
    """YAML text → Python values, with ``_StrictLoader``'s rules; any problem is one line naming ``where`` (and the
    line): invalid syntax, a repeated or non-scalar key, nesting too deep to read, aliases that expand past
    ``ALIAS_EXPANSION_LIMIT`` values."""
    try:
        return _load(text)
    except PkvError as exc:
        raise PkvError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        if problem and "nesting depth" in problem:  # LibYAML's own limit, where the pure-Python parser recurses
            raise PkvError(f"{where}: nested too deeply to read{at}") from None
        raise PkvError(f"{where}: not valid YAML{at}{f' ({problem})' if problem else ''}") from None
    except RecursionError:
        raise PkvError(f"{where}: nested too deeply to read") from None


def read_yaml(path: str | os.PathLike, what: str = "file") -> Any:
    return parse_yaml(read_text(path, what), f"{what} {path}")
