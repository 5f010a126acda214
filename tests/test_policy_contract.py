"""Every registered policy honours the same contract (this list is the registry's, not a copy of it), and a policy
from another package joins through the ``pkvbench.policies`` entry point."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from plugin_package import install_plugin, pkvbench_with

from pkvbench.policies import LayerStats, ScoringPolicy, parse_policy, policy_order, registry

LENGTH, QUERY_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 50, 6, 2, 8, 4


def stats_for(policy, seed: int = 0) -> LayerStats:
    """Random statistics holding exactly what the policy declares it needs (and the layer's entries)."""
    gen = torch.Generator().manual_seed(seed)
    needs = policy.needs
    return LayerStats(
        context_len=LENGTH,
        num_kv_heads=KV_HEADS,
        num_query_heads=QUERY_HEADS,
        layer=3,
        window_scores={w: torch.rand(QUERY_HEADS, LENGTH, generator=gen) for w in needs.windows},
        accumulated=torch.rand(QUERY_HEADS, LENGTH, generator=gen) if needs.accumulated else None,
        bidirectional={w: torch.rand(QUERY_HEADS, LENGTH, generator=gen) for w in needs.bidirectional},
        keys=torch.randn(KV_HEADS, LENGTH, HEAD_DIM, generator=gen),
        values=torch.randn(KV_HEADS, LENGTH, HEAD_DIM, generator=gen),
        output_weight=(
            torch.randn(QUERY_HEADS * HEAD_DIM, QUERY_HEADS * HEAD_DIM, generator=gen) if needs.output_weights else None
        ),
        query_stats={key: future_queries(gen) for key in needs.query_stats},
        reconstruction={chunk: torch.rand(KV_HEADS, LENGTH, generator=gen) for chunk in needs.reconstruction},
        recent_queries=torch.randn(QUERY_HEADS, max(needs.queries), HEAD_DIM, generator=gen) if needs.queries else None,
    )


def future_queries(gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A mean and a (positive semi-definite) covariance per query head."""
    spread = torch.randn(QUERY_HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    return torch.randn(QUERY_HEADS, HEAD_DIM, generator=gen), spread @ spread.transpose(1, 2) / HEAD_DIM


def instances(name: str) -> list:
    """The policy with its defaults; a wrapper around every plain scoring policy."""
    cls = registry()[name]
    if not getattr(cls, "wraps", False):
        return [cls()]
    inner = [c() for c in registry().values() if issubclass(c, ScoringPolicy)]
    return [cls(inner=policy) for policy in inner] + [parse_policy(f"{name}(pyramidkv)")]


@pytest.mark.parametrize("name", policy_order())
def test_every_registered_policy_keeps_what_its_budgets_say(name):
    for policy in instances(name):
        assert policy.summary and parse_policy(policy.label) == policy
        stats = stats_for(policy)
        recent = getattr(policy, "keeps_recent", 0) or getattr(getattr(policy, "inner", None), "keeps_recent", 0)
        for k in sorted({policy.min_budget, 10, 25, LENGTH - 1, LENGTH, LENGTH + 7}):
            for layer_k in policy.layer_budgets(k, LENGTH, LAYERS):
                kept = policy.select(stats, layer_k)
                rows = kept.tolist() if kept.dtype == torch.long else [row.nonzero().flatten().tolist() for row in kept]
                if kept.dtype == torch.bool:  # heads keep different numbers: the layer's total is what is fixed
                    assert kept.shape == (KV_HEADS, LENGTH) and int(kept.sum()) == KV_HEADS * min(layer_k, LENGTH)
                elif getattr(policy, "exact_count", True):
                    assert kept.shape == (KV_HEADS, min(layer_k, LENGTH)), (policy.label, k, layer_k)
                else:  # whole units (ChunkKV's chunks): never more than the budget
                    assert kept.shape[0] == KV_HEADS and 0 < kept.shape[1] <= min(layer_k, LENGTH)
                for row in rows:
                    assert row == sorted(set(row)) and all(0 <= p < LENGTH for p in row), "sorted, each position once"
                if layer_k >= LENGTH:
                    assert rows == [list(range(LENGTH))] * KV_HEADS
                elif recent:
                    window = set(range(LENGTH - min(recent, layer_k), LENGTH))
                    assert all(window <= set(row) for row in rows), "the recent window is kept"
                assert torch.equal(kept, policy.select(stats, layer_k)), "deterministic"


@pytest.mark.parametrize("name", policy_order())
def test_every_policy_that_cuts_while_decoding_keeps_k_with_the_newest_entries(name):
    """A decode-time cut (``--decode-budget``): k entries per head, each once, sorted, the newest ``buffer`` and the
    policy's own window among them; a policy that cannot cut says why in one line."""
    for policy in instances(name):
        refusal = policy.decoding_refusal()
        if refusal is not None:
            assert refusal and "\n" not in refusal
            continue
        stats = dataclasses.replace(stats_for(policy), positions=torch.arange(LENGTH).expand(KV_HEADS, -1) * 2, end=99)
        if policy.name == "full":  # the reference: never cut
            assert policy.select_while_decoding(stats, 5, 0).tolist() == [list(range(LENGTH))] * KV_HEADS
            continue
        for k, buffer in ((LENGTH + 1, 0), (20, 0), (20, 12), (policy.min_budget, 0)):
            kept = policy.select_while_decoding(stats, k, buffer).tolist()
            assert all(len(row) == min(k, LENGTH) and row == sorted(set(row)) for row in kept), (policy.label, k)
            newest = set(range(LENGTH - min(max(buffer, getattr(policy, "keeps_recent", 0)), k), LENGTH))
            assert all(newest <= set(row) for row in kept), (policy.label, k, buffer)


@pytest.mark.parametrize("name", policy_order())
def test_budgets_never_fall_below_the_policys_floor(name):
    policy = instances(name)[0]
    for k in (policy.min_budget, 64):
        per_layer = policy.layer_budgets(k, 1000, LAYERS)
        assert len(per_layer) == LAYERS and min(per_layer) >= min(policy.min_budget, 1000)


PLUGIN = '''
"""A policy from outside pkvbench: keep the keys with the largest norm (a ten-line example)."""
from dataclasses import dataclass

from pkvbench.policies import ScoringPolicy


@dataclass(frozen=True)
class LargestKeys(ScoringPolicy):
    name = "largestkeys"
    summary = "keys with the largest L2 norm (a plugin)"
    sink: int = 0

    def score(self, stats):
        scores = stats.keys.norm(dim=-1)
        scores[:, : self.sink] = float("inf")  # the first `sink` positions are always kept
        return scores
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The plugin above, installed into a folder of its own (put on PYTHONPATH)."""
    return install_plugin(
        tmp_path_factory.mktemp("plugin"),
        "pkvbench_largestkeys",
        PLUGIN,
        {"pkvbench.policies": {"largestkeys": "pkvbench_largestkeys:LargestKeys"}},
    )


def test_a_plugin_policy_is_listed(plugin_site):
    out = pkvbench_with(plugin_site, "list")
    assert out.returncode == 0, out.stderr
    assert "largestkeys" in out.stdout and "keys with the largest L2 norm (a plugin)" in out.stdout
    assert (
        "largestkeys"
        not in subprocess.run([sys.executable, "-m", "pkvbench", "list"], capture_output=True, text=True).stdout
    )


@pytest.mark.model
def test_a_plugin_policy_runs(plugin_site, tmp_path):
    out = pkvbench_with(
        plugin_site,
        "run",
        "--task",
        "needle",
        "--lengths",
        "500",
        "--depths",
        "50",
        "--policy",
        "full,largestkeys,largestkeys:sink=4",
        "--budget",
        "64",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in rows] == ["full", "largestkeys", "largestkeys:sink=4"]
    assert rows[1]["kv_kept"] == [64] * 30 and rows[1]["pred"]


@pytest.mark.parametrize("name", policy_order())
def test_a_policy_says_whether_it_reads_the_cached_keys_or_values(name):
    """``reads_entries`` is what an MLA model refuses a policy by (its latent cache has no per-head keys or values):
    a policy that says False selects without them; one that says True cannot."""
    for policy in instances(name) + ([parse_policy(f"{name}(snapkv):critical=true")] if name == "adakv" else []):
        stats = dataclasses.replace(stats_for(policy), keys=None, values=None)
        if policy.reads_entries:
            with pytest.raises((AttributeError, TypeError)):
                policy.select(stats, 10)
        else:
            policy.select(stats, 10)
