"""What tests (and only tests) call: one cache decoded alone, a batch's stored layers, one file written under the rule.
The wheel holds none of it (issue 48: test-only code out of the package)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from pkvbench.store.outputs import REPORT, Kind, Outputs


def decode_one(
    engine, prefill, cache, max_new_tokens: int, stop_strings: tuple[str, ...] = (), min_new_tokens: int = 0
):
    """Greedy decoding of one compressed cache at the original positions, alone (``Engine.decode_many`` of one)."""
    request = engine.request(prefill, cache, max_new_tokens, stop_strings, min_new_tokens)
    return engine.decode_many([request])[0]


def quantized_layers(entries: list, room: int, kv_heads: int) -> list:
    """The ``QuantizedLayer`` of each layer of a batch of rows stored in one format (``quantized.StoredEntries``)."""
    from pkvbench.engine.quantized import QuantizedLayer

    first = entries[0]
    return [
        QuantizedLayer([e.layers[index] for e in entries], first.format, first.dtype, room, kv_heads)
        for index in range(len(first.layers))
    ]


def write_file(
    path: str | os.PathLike,
    data: str | bytes,
    option: str = "--out",
    reads: Iterable[str | os.PathLike] = (),
    kind: Kind = REPORT,
) -> Path:
    """One file under the rule: ``Outputs(option, reads)``, added and committed."""
    outputs = Outputs(option, reads)
    outputs.add(path, data, kind)
    return outputs.commit()[0]


def count_calls(monkeypatch, owner, *names: str) -> dict[str, int]:
    """Wrap each named method of `owner` to count its calls; the returned dict fills in as they happen."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(owner, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls
