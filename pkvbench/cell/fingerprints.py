"""Selection fingerprints: what a compressed cache kept, compactly enough to commit, exactly enough to compare.

A row's ``kept_fingerprint`` is one line of text, per layer of the model:

- the **kept counts** of every head, exact (``3x64*30``: 3 heads keeping 64 each, in 30 layers in a row; heads that
  keep different numbers are written ``60/70/62``);
- an **exact hash** of the kept positions (4 bytes of BLAKE2b over each head's sorted positions): two runs kept the
  same entries in a layer exactly when the hashes agree (up to a 2⁻³² chance);
- a **MinHash sketch** of the layer's kept set, whose elements are (head, position) pairs: 16 minima of independent
  64-bit mixes (splitmix64's finaliser), of which the lowest 8 bits are kept (b-bit MinHash, Li & König 2010).
  The share of equal minima estimates the Jaccard similarity of two kept sets, corrected for the 1/256 chance that
  two different minima agree in their low 8 bits; with the counts known, the Jaccard gives the entries in common.

An unchanged stack keeps the same entries, bit for bit, so a changed hash is a fact; the sketch says by how much the
kept sets moved, which is what separates a near-tie flipped by a different summation order from a changed rule.
The same 16 mixes serve every layer: a kept set repeated in every layer (StreamingLLM's) gives the same minima in
each, so its estimate moves in steps of 1/16 (docs/ci-gate.md; a per-layer seed would need every sketch rewritten).
Pure numpy: no model, no torch.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

VERSION = "1"
SKETCH_SIZE = 16  # minima per layer: a cell of 5 samples × 30 layers averages 2,400 of them
SKETCH_BITS = 8
HASH_BYTES = 4
_MASK = np.uint64((1 << SKETCH_BITS) - 1)
# splitmix64's increments: one independent mix per sketch slot
_SEEDS = (np.arange(1, SKETCH_SIZE + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[:, None]


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs look independent even for consecutive inputs
    (kept positions are often runs: sinks, windows), which a linear hash's are not."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _layer_hash(heads: Sequence[np.ndarray]) -> bytes:
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    for positions in heads:
        digest.update(np.int64(len(positions)).tobytes())
        digest.update(np.asarray(positions, dtype=np.int64).tobytes())
    return digest.digest()


def _layer_sketch(heads: Sequence[np.ndarray]) -> bytes:
    elements = np.concatenate(
        [(np.uint64(head) << np.uint64(32)) | np.asarray(p, dtype=np.uint64) for head, p in enumerate(heads)]
        + [np.empty(0, dtype=np.uint64)]
    )
    if not len(elements):  # a layer that keeps nothing (KVzip may): agrees with nothing but itself, via the hash
        return bytes([255] * SKETCH_SIZE)
    minima = _mix(elements[None, :] + _SEEDS).min(axis=1)
    return (minima & _MASK).astype(np.uint8).tobytes()


def _counts_text(counts: list[tuple[int, ...]]) -> str:
    """``3x64*30``: per layer ``HEADSxCOUNT`` (or each head's count, ``60/70/62``), runs of equal layers ``*n``."""
    tokens = [f"{len(c)}x{c[0]}" if len(set(c)) == 1 else "/".join(map(str, c)) for c in counts]
    runs: list[list] = []
    for token in tokens:
        if runs and runs[-1][0] == token:
            runs[-1][1] += 1
        else:
            runs.append([token, 1])
    return ",".join(token if n == 1 else f"{token}*{n}" for token, n in runs)


def _parse_counts(text: str) -> list[tuple[int, ...]]:
    counts = []
    for run in text.split(","):
        token, _, repeat = run.partition("*")
        if "x" in token:
            heads, _, count = token.partition("x")
            layer = (int(count),) * int(heads)
        else:
            layer = tuple(int(c) for c in token.split("/"))
        counts.extend([layer] * (int(repeat) if repeat else 1))
    return counts


def fingerprint(kept: Sequence[Sequence[np.ndarray]]) -> str:
    """``kept[layer][head]``: the positions that head keeps (any order) → the row's ``kept_fingerprint``."""
    layers = [[np.sort(np.asarray(p, dtype=np.int64)) for p in heads] for heads in kept]
    counts = _counts_text([tuple(len(p) for p in heads) for heads in layers])
    hashes = b"".join(_layer_hash(heads) for heads in layers)
    sketch = b"".join(_layer_sketch(heads) for heads in layers)
    return " ".join([VERSION, counts, base64.b64encode(hashes).decode(), base64.b64encode(sketch).decode()])


@dataclass(frozen=True)
class Fingerprint:
    counts: list[tuple[int, ...]]  # per layer, per head
    hashes: np.ndarray  # [layers, HASH_BYTES] uint8
    sketch: np.ndarray  # [layers, SKETCH_SIZE] uint8

    @classmethod
    def parse(cls, text: str) -> Fingerprint:
        """Read a ``kept_fingerprint``; anything else is refused with what is wrong (a ``ValueError``)."""
        parts = str(text).split(" ")
        if len(parts) != 4 or parts[0] != VERSION:
            raise ValueError(f"not a version-{VERSION} kept fingerprint (version, counts, hashes, sketch)")
        try:
            counts = _parse_counts(parts[1])
            hashes = np.frombuffer(base64.b64decode(parts[2], validate=True), dtype=np.uint8)
            sketch = np.frombuffer(base64.b64decode(parts[3], validate=True), dtype=np.uint8)
        except ValueError as exc:
            raise ValueError(f"unreadable kept fingerprint: {exc}") from None
        layers = len(counts)
        if not layers or hashes.size != layers * HASH_BYTES or sketch.size != layers * SKETCH_SIZE:
            raise ValueError(f"kept fingerprint of {layers} layers with hashes or sketch of another size")
        return cls(counts, hashes.reshape(layers, HASH_BYTES), sketch.reshape(layers, SKETCH_SIZE))

    @property
    def sizes(self) -> np.ndarray:
        """Entries kept per layer, over its heads."""
        return np.array([sum(c) for c in self.counts], dtype=float)


@dataclass(frozen=True)
class Comparison:
    """One row's kept sets against another's, per layer."""

    counts_differ: np.ndarray  # [layers] bool: a head keeps another number of entries (or the heads differ)
    totals_differ: np.ndarray  # [layers] bool: the layer keeps another number of entries over its heads
    changed: np.ndarray  # [layers] bool: the kept positions are not the same
    common: np.ndarray  # [layers] entries in common (exact where unchanged, estimated from the sketch elsewhere)
    larger: np.ndarray  # [layers] the larger of the two kept sets' sizes


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """b-bit MinHash estimate of the Jaccard similarity, per row of two ``[layers, SKETCH_SIZE]`` sketches."""
    chance = 2.0**-SKETCH_BITS
    agree = (a == b).mean(axis=-1)
    return np.clip((agree - chance) / (1 - chance), 0.0, 1.0)


def compare(baseline: Fingerprint, run: Fingerprint) -> Comparison:
    if len(baseline.counts) != len(run.counts):  # another model: nothing in common that could be said
        layers = max(len(baseline.counts), len(run.counts))
        larger = np.ones(layers)
        return Comparison(np.ones(layers, bool), np.ones(layers, bool), np.ones(layers, bool), np.zeros(layers), larger)
    counts_differ = np.array([a != b for a, b in zip(baseline.counts, run.counts)])
    size_a, size_b = baseline.sizes, run.sizes
    totals_differ = np.array([len(a) != len(b) for a, b in zip(baseline.counts, run.counts)]) | (size_a != size_b)
    changed = (baseline.hashes != run.hashes).any(axis=1) | counts_differ
    similarity = jaccard(baseline.sketch, run.sketch)
    estimated = similarity * (size_a + size_b) / (1 + similarity)  # |A ∩ B| from J = |A ∩ B| / |A ∪ B|
    common = np.where(changed, np.minimum(estimated, np.minimum(size_a, size_b)), size_a)
    return Comparison(counts_differ, totals_differ, changed, common, np.maximum(size_a, size_b))
