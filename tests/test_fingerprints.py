"""Selection fingerprints (pkvbench/cell/fingerprints.py): exact where nothing changed, a fair estimate of the entries in
common where something did, compact enough to commit."""

import numpy as np
import pytest

from pkvbench.cell.fingerprints import Fingerprint, compare, fingerprint


def random_layers(rng, layers=30, heads=3, keep=64, length=1000):
    return [[rng.choice(length, size=keep, replace=False) for _ in range(heads)] for _ in range(layers)]


def exact_overlap(a, b):
    common = sum(len(np.intersect1d(x, y)) for la, lb in zip(a, b) for x, y in zip(la, lb))
    larger = sum(max(sum(map(len, la)), sum(map(len, lb))) for la, lb in zip(a, b))
    return common / larger


def test_the_same_kept_sets_in_any_order_are_identical():
    rng = np.random.default_rng(0)
    layers = random_layers(rng)
    shuffled = [[rng.permutation(head) for head in heads] for heads in layers]
    text = fingerprint(layers)
    assert text == fingerprint(shuffled)
    result = compare(Fingerprint.parse(text), Fingerprint.parse(fingerprint(shuffled)))
    assert not result.changed.any() and not result.counts_differ.any()
    assert result.common.sum() == result.larger.sum() == 30 * 3 * 64


def test_one_moved_entry_changes_its_layer_only():
    rng = np.random.default_rng(1)
    layers = random_layers(rng)
    moved = [[head.copy() for head in heads] for heads in layers]
    moved[7][2][0] = next(p for p in range(1000) if p not in set(layers[7][2]))
    result = compare(Fingerprint.parse(fingerprint(layers)), Fingerprint.parse(fingerprint(moved)))
    assert np.flatnonzero(result.changed).tolist() == [7] and not result.counts_differ.any()
    # and the same positions kept by another head is another kept set
    swapped = [list(heads) for heads in layers]
    swapped[3][0], swapped[3][1] = layers[3][1], layers[3][0]
    result = compare(Fingerprint.parse(fingerprint(layers)), Fingerprint.parse(fingerprint(swapped)))
    assert np.flatnonzero(result.changed).tolist() == [3]


@pytest.mark.parametrize("shared", [0.3, 0.8, 0.95])
def test_the_sketch_estimates_the_entries_in_common(shared):
    """Each head keeps ``shared`` of its 64 entries and swaps the rest: over 30 layers, the estimate is within a
    few points of the truth."""
    rng = np.random.default_rng(2)
    layers = random_layers(rng, length=500)
    swap = 64 - round(64 * shared)
    changed = [[np.concatenate([head[swap:], 500 + rng.choice(500, size=swap, replace=False)]) for head in heads]
               for heads in layers]  # fmt: skip
    result = compare(Fingerprint.parse(fingerprint(layers)), Fingerprint.parse(fingerprint(changed)))
    estimate = result.common.sum() / result.larger.sum()
    assert abs(estimate - exact_overlap(layers, changed)) < 0.05, estimate


def test_counts_are_exact_per_layer_and_head_and_compact():
    layers = [[np.arange(64)] * 3] * 28 + [[np.arange(60), np.arange(70), np.arange(62)], [np.arange(5)] * 3]
    text = fingerprint(layers)
    assert text.split(" ")[1] == "3x64*28,60/70/62,3x5"
    parsed = Fingerprint.parse(text)
    assert parsed.counts[28] == (60, 70, 62) and parsed.counts[29] == (5, 5, 5) and len(parsed.counts) == 30
    assert len(text) < 1000  # 30 layers: counts, 4 bytes of hash and 16 of sketch each, base64


def test_changed_counts_are_flagged():
    layers = [[np.arange(64)] * 3] * 4
    fewer = [[np.arange(64)] * 3] * 3 + [[np.arange(64), np.arange(63), np.arange(64)]]
    result = compare(Fingerprint.parse(fingerprint(layers)), Fingerprint.parse(fingerprint(fewer)))
    assert np.flatnonzero(result.counts_differ).tolist() == [3] and np.flatnonzero(result.totals_differ).tolist() == [3]


def test_an_entry_moved_between_heads_changes_the_split_not_the_total():
    layers = [[np.arange(64)] * 3] * 4
    moved = [[np.arange(64)] * 3] * 3 + [[np.arange(63), np.arange(65), np.arange(64)]]
    result = compare(Fingerprint.parse(fingerprint(layers)), Fingerprint.parse(fingerprint(moved)))
    assert np.flatnonzero(result.counts_differ).tolist() == [3] and not result.totals_differ.any()
    assert np.flatnonzero(result.changed).tolist() == [3]


@pytest.mark.parametrize(
    "text", ["", "2 3x64 AAAA AAAA", "1 3x64 AAAA", "1 3xa AAAAAA== AAAA", "1 3x64 !!!! AAAA", "1 3x64*2 AAAAAA== AAAA"]
)
def test_a_damaged_fingerprint_is_refused(text):
    with pytest.raises(ValueError):
        Fingerprint.parse(text)
