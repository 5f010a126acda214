import itertools

import pytest

from pkvbench.cell import budgets
from pkvbench.cell.budgets import Budget, parse_budgets
from pkvbench.errors import PkvError
from pkvbench.policies import parse_policy
from pkvbench.policies.pyramidkv import pyramid


def test_parse_fraction_and_count():
    assert parse_budgets("128,0.12,0.007") == [Budget(128), Budget(0.12), Budget(0.007)]
    assert Budget.parse("128.0").value == 128 and isinstance(Budget.parse("128.0").value, int)
    assert str(Budget.parse("0.007")) == "0.007"


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1.5", "nan", "inf", "-0.1"])
def test_bad_budgets(text):
    with pytest.raises(PkvError):
        Budget.parse(text)


def test_empty_budget_list():
    with pytest.raises(PkvError):
        parse_budgets(" , ")


def test_fraction_rounds_to_nearest():
    assert Budget(0.007).entries(2000) == 14
    assert Budget(0.12).entries(1000) == 120
    assert Budget(0.0025).entries(1000) == 3  # 2.5 rounds half up
    assert Budget(0.0001).entries(100) == 1  # never below one entry


def test_pyramid_matches_the_paper_formula_and_spends_exactly():
    per_layer = pyramid(128, 8192, 32, window=8, beta=20)
    assert sum(per_layer) == 32 * 128
    assert per_layer[0] == 8 + 234  # bottom: 2(k-w) - (k-w)/beta = 240 - 6
    assert per_layer[-1] == 8 + 6  # top: (k-w)/beta
    assert per_layer == sorted(per_layer, reverse=True)
    steps = {a - b for a, b in itertools.pairwise(per_layer)}
    assert steps <= {7, 8}  # a linear sequence, up to rounding (ideal step 228/31 = 7.35)


@pytest.mark.parametrize(
    "k,length,layers,window,beta",
    list(itertools.product([9, 20, 64, 128, 500], [100, 1000, 8192], [1, 2, 30, 32], [8, 32], [20, 5])),
)
def test_pyramid_total_and_bounds(k, length, layers, window, beta):
    per_layer = pyramid(k, length, layers, window=window, beta=beta)
    assert len(per_layer) == layers
    if k >= length:
        assert per_layer == [length] * layers
        return
    assert sum(per_layer) == k * layers
    assert per_layer == sorted(per_layer, reverse=True)
    assert all(min(window, k) <= n <= length for n in per_layer)


def test_pyramid_clamps_at_the_prompt_length():
    # k - w = 120; the bottom layer would want 234 beyond the window but only T - w = 192 exist.
    per_layer = pyramid(128, 200, 30, window=8, beta=20)
    assert per_layer[0] == 200
    assert sum(per_layer) == 30 * 128
    assert per_layer[-1] == 8 + (240 - 192)  # the top recomputed as 2(k-w) - (T-w)


def test_plan_applies_floor_and_records_it():
    plan = budgets.plan(parse_policy("snapkv"), Budget(0.001), 2000, 30)
    assert plan.requested == 2 and plan.effective == 8  # the window is the floor
    assert plan.per_layer == [8] * 30 and plan.compressed
    plan = budgets.plan(parse_policy("pyramidkv"), Budget(0.007), 2000, 30)
    assert plan.requested == 14 and sum(plan.per_layer) == 14 * 30


def test_plan_does_not_compress_short_prompts():
    for spec in ("streamingllm", "h2o", "snapkv", "pyramidkv", "full"):
        plan = budgets.plan(parse_policy(spec), Budget(128), 100, 30)
        assert plan.per_layer == [100] * 30 and not plan.compressed


def test_full_policy_plan_is_the_prompt():
    plan = budgets.plan(parse_policy("full"), Budget(64), 1000, 4)
    assert plan.per_layer == [1000] * 4 and not plan.compressed
