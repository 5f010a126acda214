"""Bugs planted on purpose, to measure what the CI gate catches (``scripts/planted_bugs.py``, ``tests/test_gate``).

Each bug is a context manager that patches one rule for the duration of a run, in this process only, and names
the policies whose rows it changes. A gate worth having fails on every one of them against a baseline of the
unchanged code, and passes on a rerun of the unchanged code. Test and measurement code, not the package's: it lives
beside the tests (``scripts/planted_bugs.py`` puts this folder on its path).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pandas as pd

from pkvbench.cell import budgets as budget_rules
from pkvbench.policies import base, pyramidkv, snapkv, streamingllm
from pkvbench.policies.base import Needs
from pkvbench.reports.check import CheckResult, SelectionRule, check_run, samples_path


@dataclass(frozen=True)
class PlantedBug:
    name: str
    what: str
    policies: tuple[str, ...]  # the policies whose rows it changes (a run of only these shows it)
    plant: Callable[[], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _inverted() -> Iterator[None]:
    """Every scoring policy keeps its *lowest*-scoring positions."""
    original = base.best_positions
    with mock.patch.object(base, "best_positions", lambda scores, count, ties="stable": original(-scores, count, ties)):
        yield


@contextlib.contextmanager
def _window_off_by_one() -> Iterator[None]:
    """SnapKV and PyramidKV vote with one query fewer than their window (a classic slicing slip)."""
    original = snapkv.SnapKV.score

    def needs(self) -> Needs:
        return Needs(windows=frozenset({self.window, max(self.window - 1, 1)}))

    def score(self, stats):
        slipped = {**stats.window_scores, self.window: stats.window(max(self.window - 1, 1))}
        return original(self, dataclasses.replace(stats, window_scores=slipped))

    with mock.patch.object(snapkv.SnapKV, "needs", property(needs)), mock.patch.object(snapkv.SnapKV, "score", score):
        yield


@contextlib.contextmanager
def _no_pooling() -> Iterator[None]:
    """SnapKV and PyramidKV ignore their pooling kernel (scores used raw)."""
    with mock.patch.object(snapkv, "pool_scores", lambda scores, kernel, pooling: scores):
        yield


@contextlib.contextmanager
def _pyramid_reversed() -> Iterator[None]:
    """PyramidKV's budgets upside down: the top layers get the most."""
    original = pyramidkv.pyramid
    with mock.patch.object(pyramidkv, "pyramid", lambda *a, **k: list(reversed(original(*a, **k)))):
        yield


@contextlib.contextmanager
def _budget_halved() -> Iterator[None]:
    """Every compressed policy keeps half its budget (a budget off by a factor of 2)."""
    original = budget_rules.plan

    def halved(policy, budget, context_len, num_layers):
        layer_plan = original(policy, budget, context_len, num_layers)
        if not layer_plan.compressed:
            return layer_plan
        return dataclasses.replace(layer_plan, per_layer=[max(1, k // 2) for k in layer_plan.per_layer])

    with mock.patch.object(budget_rules, "plan", halved):
        yield


@contextlib.contextmanager
def _no_sinks() -> Iterator[None]:
    """StreamingLLM forgets its attention sinks: only the most recent entries are kept."""
    original = streamingllm.StreamingLLM.score

    def score(self, stats):
        return original(dataclasses.replace(self, sink=0), stats)

    with mock.patch.object(streamingllm.StreamingLLM, "score", score):
        yield


@contextlib.contextmanager
def _ties_to_later() -> Iterator[None]:
    """Among equal scores the *later* position is kept (the stable order reversed): max-pooling makes plateaus of
    equal scores, so SnapKV and PyramidKV keep other entries at their top-k boundary."""
    original = base.best_positions

    def later(scores, count, ties="stable"):
        return scores.shape[-1] - 1 - original(scores.flip(-1), count, ties)

    with mock.patch.object(base, "best_positions", later):
        yield


@contextlib.contextmanager
def _gqa_max() -> Iterator[None]:
    """SnapKV's (and so PyramidKV's and AdaKV-over-SnapKV's) default fold of a query group changed from mean to max
    (a changed default option: ``gqa=mean`` is what the rows still say)."""
    original = snapkv.SnapKV.score

    def score(self, stats):
        return original(dataclasses.replace(self, gqa="max") if self.gqa == "mean" else self, stats)

    with mock.patch.object(snapkv.SnapKV, "score", score):
        yield


SCORING = ("streamingllm", "h2o", "snapkv", "pyramidkv")
BUGS = (
    PlantedBug("inverted", "scoring policies keep their lowest-scoring positions", SCORING, _inverted),
    PlantedBug("budget-halved", "every compressed cache keeps half its budget", SCORING, _budget_halved),
    PlantedBug("pyramid-reversed", "PyramidKV's per-layer budgets upside down", ("pyramidkv",), _pyramid_reversed),
    PlantedBug("no-pooling", "SnapKV/PyramidKV ignore the pooling kernel", ("snapkv", "pyramidkv"), _no_pooling),
    PlantedBug(
        "window-off-by-one", "SnapKV/PyramidKV vote with w−1 queries", ("snapkv", "pyramidkv"), _window_off_by_one
    ),
    PlantedBug("no-sinks", "StreamingLLM keeps no attention sinks", ("streamingllm",), _no_sinks),
    PlantedBug("ties-to-later", "equal scores keep the later position", ("snapkv", "pyramidkv"), _ties_to_later),
    PlantedBug(
        "gqa-max", "SnapKV folds a query group by max, not mean", ("snapkv", "pyramidkv", "adakv(snapkv)"), _gqa_max
    ),
)
BUGS_BY_NAME = {bug.name: bug for bug in BUGS}


def baseline_for(baseline: Path, policies: tuple[str, ...], path: Path, tasks: tuple[str, ...] | None = None) -> Path:
    """A baseline (cells and per-sample scores) cut to ``policies`` (and ``tasks``, if given), written to ``path``
    (its samples beside it): the gate then asks only for the rows a run of those has."""
    for source, target in ((baseline, path), (samples_path(baseline), samples_path(path))):
        table = pd.read_csv(source, dtype=str)
        keep = table["policy"].isin(policies) & (table["task"].isin(tasks) if tasks else True)
        table[keep].to_csv(target, index=False)
    return path


def check_with_bug(
    bug: PlantedBug,
    config: Path,
    baseline: Path,
    folder: Path,
    tolerance: float = 2.0,
    rule: SelectionRule | None = None,
    tasks: tuple[str, ...] | None = None,
) -> CheckResult:
    """Run ``config``'s grid for the bug's policies (and ``tasks``, if given: else the config's) with the bug
    planted, into ``folder`` (resuming a run there), and check it against ``baseline``: the ``CheckResult`` of
    ``pkvbench check`` (``passed`` False: caught)."""
    from pkvbench.api import RunConfig, evaluate

    out = folder / bug.name
    only = {"tasks": list(tasks)} if tasks else {}
    with bug.plant():
        evaluate(RunConfig.from_file(config, policies=list(bug.policies), out=str(out), quiet=True, **only))
    cut = baseline_for(baseline, bug.policies, folder / f"{bug.name}-baseline.csv", tasks)
    return check_run([str(out)], str(cut), tolerance, None, rule)
