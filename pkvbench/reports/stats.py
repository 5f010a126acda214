"""How sure a number is: bootstrap intervals, paired comparisons of policies, Holm's correction, samples needed.

Pure functions of per-sample scores (numbers in [0, 1]; tables multiply by 100). Every random draw comes from a
generator seeded with ``SEED``, so the same rows always give the same intervals and p-values.

- ``mean_interval``: the 95% percentile-bootstrap interval of a mean over samples. Percentile rather than BCa:
  per-sample scores are often 0/1 with few distinct values, where BCa's jackknife degenerates.
- ``group_interval``: the interval of a mean of task means (LongBench's group average), resampling *within* each
  task, so every resample keeps each task's sample count and weight.
- ``paired_difference``: policy A minus policy B on the same samples: the mean difference (per-task means averaged
  when strata are given), its paired-bootstrap interval, and a two-sided sign-flip permutation p-value — under "A
  and B are exchangeable" each sample's difference is as likely negated; exact (every 2^n flip) up to n = 13.
- ``holm``: Holm–Bonferroni adjusted p-values for a family of comparisons.
- ``samples_needed``: the n at which a paired test at level alpha detects a difference with the given power, from the
  observed spread of per-sample differences (normal approximation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
ALPHA = 0.05  # the level at which a paired difference counts as decided (after Holm), in `diff` and the gate
RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by well under a point between seeds at this count
PERMUTATIONS = 9999  # sign flips; every one of the 2^n is enumerated when 2^n is fewer
SEED = 0


def _finite(values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    return array[np.isfinite(array)]


def _rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The bootstrap interval of the mean of ``values`` (NaNs ignored); values that never vary give the point
    itself (no resample could differ), none gives (nan, nan)."""
    return group_interval([values], confidence)


def group_interval(groups: Sequence[Sequence[float]], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile-bootstrap interval of the mean of the groups' means, each group resampled within itself
    (a stratified bootstrap: every resample keeps each group's size and weight).

    Written with numpy rather than scipy's ``bootstrap``, which cannot resample a group of one sample (a LongBench
    task with one row, a cell of a ``--limit 1`` run) and would have to special-case it."""
    data = [g for g in (_finite(group) for group in groups) if g.size]
    if not data:
        return math.nan, math.nan
    if all(np.all(g == g[0]) for g in data):
        point = float(np.mean([g[0] for g in data]))
        return point, point
    rng = _rng()
    means = np.zeros(RESAMPLES)
    for group in data:
        means += group[rng.integers(0, group.size, size=(RESAMPLES, group.size))].mean(axis=1)
    means /= len(data)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class PairedDifference:
    """A − B over ``n`` paired samples: ``mean`` with its interval [``low``, ``high``] and the sign-flip ``p``."""

    n: int
    mean: float
    low: float
    high: float
    p: float

    @property
    def decided(self) -> bool:
        """The interval excludes 0: the data say which policy is better (before any multiple-comparison care)."""
        return self.low > 0 or self.high < 0


def _weights(strata: Sequence | None, n: int) -> np.ndarray:
    """Per-pair weights that turn a weighted sum into the mean of per-stratum means (plain mean without strata)."""
    if strata is None:
        return np.full(n, 1.0 / n)
    labels = np.asarray([str(s) for s in strata])
    names, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    return 1.0 / (len(names) * counts[inverse])


def paired_difference(
    first: Sequence[float], second: Sequence[float], strata: Sequence | None = None, confidence: float = CONFIDENCE
) -> PairedDifference:
    """Compare two policies' scores on the same samples (``first[i]`` and ``second[i]`` are one sample). With
    ``strata`` (each pair's task), the difference is the mean of per-task mean differences, resampled within tasks."""
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired scores need one value of each policy per sample")
    keep = np.isfinite(a) & np.isfinite(b)
    differences = (a - b)[keep]
    labels = None if strata is None else np.asarray([str(s) for s in strata])[keep]
    n = int(differences.size)
    if n == 0:
        return PairedDifference(0, math.nan, math.nan, math.nan, math.nan)
    weights = _weights(labels, n)
    mean = float(differences @ weights)
    if labels is None:
        low, high = mean_interval(differences, confidence)
    else:
        low, high = group_interval([differences[labels == name] for name in dict.fromkeys(labels)], confidence)
    return PairedDifference(n, mean, low, high, sign_flip_p(differences, weights))


def sign_flip_p(differences: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Two-sided p-value of a weighted mean of paired differences against "no difference": the share of sign flips
    whose statistic is at least as far from 0 as the observed one."""
    differences = np.asarray(differences, dtype=float)
    if differences.size < 2 or np.all(differences == 0):  # one pair: its two flips are equally far from 0
        return 1.0
    weights = np.full(differences.size, 1.0 / differences.size) if weights is None else np.asarray(weights)
    result = scipy_stats.permutation_test(
        (differences,),
        lambda x, axis=-1: np.sum(x * weights, axis=axis),
        permutation_type="samples",  # one sample: each permutation flips the signs of some differences
        alternative="two-sided",
        n_resamples=PERMUTATIONS,
        vectorized=True,
        rng=_rng(),
    )
    return float(min(1.0, result.pvalue))


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (NaN stays NaN): the i-th smallest of m is multiplied by m − i + 1, then
    made non-decreasing in that order and capped at 1."""
    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    valid = np.flatnonzero(np.isfinite(p))
    order = valid[np.argsort(p[valid], kind="stable")]
    m = len(order)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def samples_needed(sd_difference: float, effect: float, alpha: float = ALPHA, power: float = 0.8) -> float:
    """Paired samples for a two-sided test at ``alpha`` to detect a mean difference of ``effect`` with ``power``,
    when per-sample differences spread by ``sd_difference`` (same units as ``effect``): ((z₁₋α/₂ + z_power) σ / δ)²,
    rounded up. Infinite when the effect is 0; 1 when the differences never vary (one sample shows them)."""
    if effect == 0 or not math.isfinite(sd_difference):
        return math.inf
    if sd_difference == 0:
        return 1
    z = scipy_stats.norm.ppf(1 - alpha / 2) + scipy_stats.norm.ppf(power)
    return max(2, math.ceil((z * sd_difference / abs(effect)) ** 2))


def cell_scores(frame: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Per group of ``axes``: ``n`` scored samples, ``score`` (mean × 100) and its interval ``ci_low, ci_high``
    (× 100), two decimals: the cells of ``summary.csv`` and of the CI gate."""
    cells = []
    for key, scores in frame.groupby(axes, sort=False)["score"]:
        low, high = mean_interval(scores)
        cells.append([*key, int(scores.count()), scores.mean() * 100, low * 100, high * 100])
    table = pd.DataFrame(cells, columns=[*axes, "n", "score", "ci_low", "ci_high"])
    table[["score", "ci_low", "ci_high"]] = table[["score", "ci_low", "ci_high"]].round(2)
    return table
