"""Why does default H2O answer the needle the same way at every budget? Look at what it keeps.

For needle prompts on the embedded model, per policy and budget: the share of kept entries (all layers, all KV
heads) that lie in the first 10% of the prompt, the share of the question's tokens that are kept, and whether the
needle's tokens are kept. Run:  python scripts/h2o_diagnosis.py --lengths 2000 --budgets 64,128
"""

from __future__ import annotations

import click
import torch

from pkvbench.cell.budgets import parse_budgets
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.policies import parse_policy
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task


def span_of(haystack: list[int], needle: list[int]) -> range:
    """Token positions of the last occurrence of ``needle`` in ``haystack``."""
    for start in range(len(haystack) - len(needle), -1, -1):
        if haystack[start : start + len(needle)] == needle:
            return range(start, start + len(needle))
    raise ValueError("not found")


@click.command()
@click.option("--lengths", default="2000")
@click.option("--depths", default="0,50,100")
@click.option("--budgets", "budget_text", default="64,128")
@click.option("--policies", default="h2o,h2o:normalize=true,h2o:scores=window,snapkv,snapkv:window=32")
def main(lengths, depths, budget_text, policies):
    loaded = load_model()
    engine = Engine(loaded)
    task = get_task("needle")
    tokenizer = loaded.tokenizer
    options = TaskOptions(
        lengths=tuple(int(x) for x in lengths.split(",")), depths=tuple(float(x) for x in depths.split(","))
    )
    chosen = [parse_policy(p) for p in policies.split(",")]
    question_ids = tokenizer(task.config["question"], add_special_tokens=False)["input_ids"]
    needle_ids = tokenizer(task.config["needle"].strip(), add_special_tokens=False)["input_ids"][2:-2]
    print("sample | policy | budget | kept in first 10% | question tokens kept | needle tokens kept")
    for sample in build_samples(task, tokenizer, options):
        prefill = engine.prefill(torch.tensor([sample.input_ids]), chosen)
        question, needle = span_of(sample.input_ids, question_ids), span_of(sample.input_ids, needle_ids)
        head = prefill.context_len // 10
        for policy in chosen:
            for budget in parse_budgets(budget_text):
                per_layer = policy.layer_budgets(
                    budget.entries(prefill.context_len), prefill.context_len, loaded.num_layers
                )
                kept = torch.cat([policy.select(stats, k).flatten() for stats, k in zip(prefill.stats, per_layer)])
                slots = loaded.num_layers * loaded.num_kv_heads  # each position can be kept once per layer and KV head
                in_head = (kept < head).float().mean().item()
                q_kept = torch.isin(kept, torch.tensor(list(question))).sum().item() / (len(question) * slots)
                n_kept = torch.isin(kept, torch.tensor(list(needle))).sum().item() / (len(needle) * slots)
                print(f"{sample.sample_id} | {policy.label} | {budget} | {in_head:.2f} | {q_kept:.2f} | {n_kept:.2f}")


if __name__ == "__main__":
    main()
