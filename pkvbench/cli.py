"""The ``pkvbench`` command line: parse, validate, call. Every error a user can cause is one line and exit 2."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from pkvbench import __version__
from pkvbench.budgets import Budget, parse_budgets, plan
from pkvbench.engine.models import ALIASES, DEFAULT_MODEL, DEVICES, DTYPES, SUPPORTED_ARCHITECTURES, check_model_name
from pkvbench.errors import PkvError
from pkvbench.policies import POLICIES, check_shared_options, parse_option_pairs, parse_policy

ALL_POLICIES = ",".join(POLICIES)


def split_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise PkvError(f"{what} is empty; give a comma-separated list")
    return items


def parse_numbers(text: str | None, what: str, kind: type) -> tuple | None:
    if text is None:
        return None
    values = []
    for item in split_list(text, what):
        try:
            value = kind(item)
        except ValueError:
            raise PkvError(f"{what}: {item!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < 0 or (kind is int and value == 0):
            raise PkvError(f"{what}: {item!r} must be positive")
        values.append(value)
    return tuple(dict.fromkeys(values))


def parse_policies(text: str, policy_args: tuple[str, ...]):
    shared = parse_option_pairs(list(policy_args))
    policies = [parse_policy(spec, shared) for spec in split_list(text, "--policy")]
    check_shared_options(shared, policies)
    return list({p.label: p for p in policies}.values())


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pkvbench")
def cli() -> None:
    """What KV-cache compression costs in accuracy, at what budget.

    Runs PyramidKV and its baselines (full cache, StreamingLLM, H2O, SnapKV) on long-context tasks at the budgets
    you give and writes per-sample results and a summary table.
    """


@cli.command()
@click.option("--task", default="needle", show_default=True, help="Task name(s), comma-separated (see `pkvbench list`).")
@click.option("--policy", default=ALL_POLICIES, show_default=True,
              help="Policies, comma-separated; options inline as name:opt=value, e.g. snapkv:window=32.")
@click.option("--budget", default="128", show_default=True,
              help="Budgets, comma-separated: below 1 a fraction of the prompt (0.007 = 0.7%), else entries per KV head per layer.")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="NAME=VALUE",
              help="Option for every policy that has it (window, sink, kernel, pooling, beta, gqa, scores, normalize). Repeatable.")
@click.option("--lengths", help="Context lengths in prompt tokens, comma-separated (needle default: 1000,2000,4000).")
@click.option("--depths", help="Needle depths in percent, comma-separated (default: 0,25,50,75,100).")
@click.option("--limit", type=int, help="At most this many samples per task.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated tasks and torch.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Folder with a task's data files (e.g. LongBench <name>.jsonl).")
@click.option("--no-verify", is_flag=True, help="Do not check data files against their known checksums.")
@click.option("--max-length", type=click.IntRange(min=1), help="Truncate longer prompts to this many tokens (tasks that do).")
@click.option("--sample-id", "sample_ids", help="Only these sample ids, comma-separated.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help=f"Alias ({', '.join(ALIASES)}), Hugging Face model id, or local folder.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(DEVICES))
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPES),
              help="auto = float32 on CPU, bfloat16 on CUDA.")
@click.option("--attn-implementation", default="sdpa", show_default=True, help="transformers attention kernel (sdpa, eager, flash_attention_2, ...).")
@click.option("--max-new-tokens", type=int, help="Override the task's answer length.")
@click.option("--out", type=click.Path(file_okay=False), help="Result folder (default: results/runs/<model>/<tasks>).")
@click.option("--overwrite", is_flag=True, help="Discard what --out holds and start afresh.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(task, policy, budget, policy_args, lengths, depths, limit, seed, data_dir, no_verify, max_length, sample_ids,
        model, device, dtype, attn_implementation, max_new_tokens, out, overwrite, quiet) -> None:
    """Run policies × budgets over a task's samples; write samples.jsonl, summary.csv and run.json.

    Each sample is prefilled once; every policy × budget derives its cache from that prefill. Rerunning the same
    command with the same --out does only what is missing.

    \b
    Example:
      pkvbench run --task needle --policy full,snapkv,pyramidkv --budget 128,0.12 --lengths 1000,2000 --depths 0,50,100
    """
    from pkvbench.tasks.base import TaskOptions
    from pkvbench.tasks.registry import get_task

    tasks = [get_task(name) for name in dict.fromkeys(split_list(task, "--task"))]
    policies = parse_policies(policy, policy_args)
    budgets = parse_budgets(budget)
    options = TaskOptions(
        lengths=parse_numbers(lengths, "--lengths", int),
        depths=parse_numbers(depths, "--depths", float),
        limit=limit,
        seed=seed,
        data_dir=data_dir,
        verify=not no_verify,
        max_length=max_length,
        sample_ids=tuple(split_list(sample_ids, "--sample-id")) if sample_ids is not None else None,
    )
    if max_new_tokens is not None and max_new_tokens < 1:
        raise PkvError("--max-new-tokens must be at least 1")
    out = Path(out or Path("results/runs") / model.replace("/", "--") / "+".join(t.name for t in tasks))
    run_options = {
        "model": model, "device": device, "dtype": dtype, "attn_implementation": attn_implementation,
        "tasks": [t.name for t in tasks], "policies": [p.label for p in policies],
        "budgets": [b.value for b in budgets], "lengths": options.lengths, "depths": options.depths,
        "limit": limit, "seed": seed, "max_new_tokens": max_new_tokens, "data_dir": data_dir,
        "max_length": max_length, "sample_ids": options.sample_ids,
    }
    run_options = json.loads(json.dumps(run_options))  # tuples → lists, as they will read back from run.json

    import torch

    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model
    from pkvbench.results import ResultStore
    from pkvbench.runner import run_grid

    check_model_name(model)
    store = ResultStore(out)
    # Check the folder before the (slow) model load, and record the run once the model is known.
    store.open({"options": run_options}, overwrite=overwrite)
    torch.manual_seed(seed)
    loaded = load_model(model, device=device, dtype=dtype, attn_implementation=attn_implementation)
    store.open(
        {
            "options": run_options,
            "model": {"name": loaded.name, "source": loaded.source, "device": loaded.device, "dtype": loaded.dtype,
                      "layers": loaded.num_layers, "kv_heads": loaded.num_kv_heads, "head_dim": loaded.head_dim},
            "policies": {p.label: p.options for p in policies},
            "versions": {"pkvbench": __version__, "torch": torch.__version__, "transformers": _version("transformers"),
                         "python": platform.python_version()},
            "commit": git_commit(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    )
    try:
        stats = run_grid(Engine(loaded), tasks, policies, budgets, options, store, max_new_tokens=max_new_tokens, quiet=quiet)
    finally:
        table = store.write_summary()
    if not quiet:
        click.echo(table.to_string(index=False) if len(table) else "(no rows)")
    click.echo(
        f"{stats.written} rows written, {stats.skipped} already done, {stats.prefills} prefills, "
        f"{stats.seconds:.1f} s → {out}/samples.jsonl, {out}/summary.csv"
    )


@cli.command()
@click.option("--policy", default="pyramidkv", show_default=True, help="Policies, comma-separated (options as in `run`).")
@click.option("--budget", default="128", show_default=True, help="Budgets, comma-separated (fractions or entry counts).")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="NAME=VALUE", help="Option for every policy that has it.")
@click.option("--layers", type=click.IntRange(min=1), default=30, show_default=True, help="Number of layers (30 = the embedded model).")
@click.option("--context", type=click.IntRange(min=1), default=8192, show_default=True, help="Prompt length T in tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def budgets(policy, budget, policy_args, layers, context, as_json) -> None:
    """Per-layer budgets (entries per KV head) a policy would keep: the function the engine uses."""
    entries = []
    for pol in parse_policies(policy, policy_args):
        for bud in parse_budgets(budget):
            layer_plan = plan(pol, bud, context, layers)
            entries.append({
                "policy": pol.label, "budget": bud.value, "context": context, "layers": layers,
                "requested": layer_plan.requested, "effective": layer_plan.effective,
                "compressed": layer_plan.compressed, "total": sum(layer_plan.per_layer),
                "mean": layer_plan.mean, "per_layer": layer_plan.per_layer,
            })
    if as_json:
        click.echo(json.dumps(entries if len(entries) > 1 else entries[0], indent=2))
        return
    for e in entries:
        click.echo(f"{e['policy']} at budget {Budget(e['budget'])} (T={context}, L={layers}): mean {e['mean']:g}, "
                   f"total {e['total']}, requested {e['requested']}, {'compressed' if e['compressed'] else 'not compressed'}")
        click.echo("  per layer (0 = bottom): " + " ".join(map(str, e["per_layer"])))


@cli.command(name="list")
def list_() -> None:
    """Tasks, policies (with their options), model aliases and supported architectures."""
    from pkvbench.tasks.registry import all_tasks

    click.echo("Tasks:")
    for spec in all_tasks().values():
        click.echo(f"  {spec.name:14} {spec.description}")
    click.echo("Policies (options with defaults):")
    for name, cls in POLICIES.items():
        defaults = " ".join(f"{k}={v}" for k, v in cls().options.items())
        click.echo(f"  {name:14} {cls.summary}" + (f"\n  {'':14} [{defaults}]" if defaults else ""))
    click.echo("Models:")
    for name, alias in ALIASES.items():
        click.echo(f"  {name:14} {alias.description} (from {alias.distribution}=={alias.version})")
    click.echo(f"  or any Hugging Face id / local folder of: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _quiet_libraries() -> None:
    """Library chatter (load bars, GGUF notices) would bury our own output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", module="transformers")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    _quiet_libraries()
    try:
        code = cli.main(args=argv, prog_name="pkvbench", standalone_mode=False)
    except PkvError as exc:
        click.echo(f"pkvbench: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help())
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"pkvbench: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, click.Abort):
        click.echo("pkvbench: interrupted; every finished row is saved, rerun the same command to resume", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug, not bad input: still one line, with a way to see more
        if os.environ.get("PKVBENCH_DEBUG"):
            raise
        click.echo(f"pkvbench: internal error: {type(exc).__name__}: {exc} (PKVBENCH_DEBUG=1 shows the traceback)", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
