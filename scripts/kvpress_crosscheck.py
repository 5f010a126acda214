"""Each policy against NVIDIA kvpress's press of the same rule, press by press: the positions each keeps, per layer and
KV head, on the same prompt and the same tokens, at compression ratios 0.5 / 0.75 / 0.9; and the answers.

    .venv/bin/python scripts/kvpress_crosscheck.py --kvpress-python .venv-kvpress/bin/python \\
        --out docs/kvpress-crosscheck.md                                # about 5 minutes on 2 cores

The prompt is the needle task's (with its system message) at ``--length`` tokens, the question after compression as
kvpress asks it. pkvbench prefills it once and selects with every policy of ``PAIRS`` (its kvpress preset,
``--protocol kvpress``, unless the pair says otherwise) at the budgets ``cr<ratio>``; ``scripts/kvpress_presses.py``
runs in kvpress's environment (``scripts/kvpress_env.sh``) and reports what each press kept, per layer and head. Both
use pkvbench's float copy of the model; kvpress's tokens are checked equal to pkvbench's.

Each pair is expected either to keep the same sets or to differ in a stated way (``EXPECTATIONS``), which is checked,
not assumed: the table says whether it holds. ``tests/test_kvpress_crosscheck.py`` runs the same comparison on a short
prompt wherever kvpress's environment exists.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model, model_path
from pkvbench.engine.reconstruction import SINK, chat_frame
from pkvbench.io import atomic_write
from pkvbench.policies import parse_policy
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

RATIOS = (0.5, 0.75, 0.9)


@dataclass(frozen=True)
class Pair:
    """A pkvbench policy (``spec`` read under ``protocol``) and the kvpress press (a name of kvpress_presses.PRESSES)
    whose rule it is; ``expect`` names how their kept sets relate (``EXPECTATIONS``), ``why`` says why."""

    spec: str
    press: str
    protocol: str = "kvpress"
    expect: str = "identical"
    why: str = ""


PAIRS = [
    Pair("knorm", "knorm"),
    Pair(
        "knorm",
        "knorm",
        "exact",
        "equal scores",
        "pkvbench's default gives a tie to the earlier position, kvpress to torch.topk (knorm.py)",
    ),
    Pair("keydiff", "keydiff"),
    Pair("tova", "tova"),
    Pair("streamingllm", "streaming_llm"),
    Pair("expected_attention", "expected_attention_alone"),
    Pair("snapkv", "snapkv"),
    Pair(
        "pyramidkv",
        "pyramidkv",
        expect="nested",
        why="same scores, other per-layer counts: kvpress's pyramid keeps round(max − l·step) from its float "
        "arithmetic on T·(1 − r), pkvbench's apportions L·k exactly (policies/pyramidkv.py); kvpress's answer fails where its "
        "layers keep different numbers of entries",
    ),
    Pair("random", "random_seed0"),
    Pair(
        "random",
        "random_seed0",
        "exact",
        "layer 0",
        "pkvbench seeds each layer apart (seed·1000003 + layer), kvpress re-seeds every layer with the seed: "
        "layer 0 is the same draw (random.py)",
    ),
    Pair("adakv(snapkv)", "adakv_snapkv"),
    Pair("adakv(expected_attention)", "adakv_expected_attention"),
    Pair("adakv(expected_attention:epsilon=0.01)", "expected_attention"),
    Pair("adakv(snapkv):critical=true", "critical_adakv_snapkv"),
    Pair("adakv(expected_attention:vnorm=false):critical=true", "critical_adakv_expected_attention"),
    Pair("chunkkv(snapkv)", "chunkkv"),
    Pair(
        "chunkkv(snapkv:window=64:kernel=5:pooling=avg):pinned=max+1",
        "chunkkv",
        "exact",
        "kvpress within",
        "pkvbench's default fills k with whole chunks while they fit, kvpress keeps int(n_chunks·(1 − r)) of them: "
        "same ranking (with kvpress's window score, pinned=max+1), kvpress's chunks a subset (chunkkv.py)",
    ),
    Pair(
        "chunkkv(knorm)",
        "chunkkv_knorm",
        why="kvpress's answer fails where layers keep different numbers of entries (the short last chunk kept in "
        "some layers only): transformers 5.2's mask is sized by layer 0",
    ),
    Pair(
        "kvzip",
        "kvzip",
        expect="kvzip",
        why="same scores (compared apart); pkvbench keeps the chat prefix, which kvpress leaves unscored past its 4 "
        "sinks, and keeps Σ H·int(T(1 − r)) where kvpress prunes int(L·H·T·r) over all layers (kvzip.py)",
    ),
]


def nested(mine: np.ndarray, theirs: np.ndarray) -> bool:
    """Per layer and head, one set within the other."""
    both = mine & theirs
    return bool(np.all((both == mine).all(axis=-1) | (both == theirs).all(axis=-1)))


def equal_scores(mine, theirs, scores) -> bool:
    """Per layer and head, the kept scores are the same multiset: the sets differ only among equal scores."""
    for layer, (a, b) in enumerate(zip(mine, theirs)):
        for head in range(a.shape[0]):
            if not np.array_equal(np.sort(scores[layer][head][a[head]]), np.sort(scores[layer][head][b[head]])):
                return False
    return True


def kvzip_relation(mine, theirs, prefix, scores) -> bool:
    """pkvbench keeps the chat prefix, kvpress its first 4 positions (sinks); past the prefix both keep a top set of
    the same scores over all layers and heads: the smaller set lies within the larger, but for entries whose score
    is the larger set's lowest to float rounding (pkvbench's fused pass rounds differently from kvpress's)."""
    if not (mine[..., :prefix].all() and theirs[..., :SINK].all()):
        return False
    mine, theirs, scores = mine[..., prefix:], theirs[..., prefix:], scores[..., prefix:]
    small, large = (mine, theirs) if mine.sum() <= theirs.sum() else (theirs, mine)
    outside = small & ~large
    lowest = scores[large].min()
    return bool(np.all(np.abs(scores[outside] - lowest) <= 1e-4 * abs(lowest)))


def check(expect: str, mine: np.ndarray | None, theirs: np.ndarray | None, context: dict) -> bool:
    if expect == "kvpress fails":
        return theirs is None
    if mine is None or theirs is None:
        return False
    if expect == "identical":
        return bool(np.array_equal(mine, theirs))
    if expect == "nested":
        return nested(mine, theirs)
    if expect == "kvpress within":
        return bool(np.all(mine | ~theirs))
    if expect == "layer 0":
        return bool(np.array_equal(mine[0], theirs[0]))
    if expect == "equal scores":
        return equal_scores(mine, theirs, context["scores"])
    if expect == "kvzip":
        return kvzip_relation(mine, theirs, context["prefix"], context["kvzip"])
    raise ValueError(f"unknown expectation {expect!r}")


def kvpress_prompt(engine: Engine, sample, system: str) -> dict:
    """The prompt as kvpress's pipeline takes it: the context as text past the chat prefix (kvpress applies the
    template), the question as the text after it up to the template's closing tokens, and pkvbench's tokens."""
    tokenizer, question = engine.tokenizer, sample.questions[0]
    prefix, _ = chat_frame(tokenizer, sample.context_ids)
    special = set(tokenizer.all_special_ids)
    end = next((i for i, token in enumerate(question.ids) if token in special), len(question.ids))
    return {
        "context": tokenizer.decode(sample.context_ids[prefix:]),
        "question": tokenizer.decode(question.ids[:end]),
        "system": system,
        "prompt_ids": sample.input_ids,
    }


def run_kvpress(python: str, model: str, prompt: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        prompt_file, out_file = Path(folder) / "prompt.json", Path(folder) / "kept.json"
        prompt_file.write_text(json.dumps(prompt))
        script = Path(__file__).with_name("kvpress_presses.py")
        command = [python, str(script), "--prompt", str(prompt_file), "--model", model, "--out", str(out_file)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise click.ClickException(f"kvpress_presses.py exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        return json.loads(out_file.read_text())


def unpack(hexes: list[str], heads: int, length: int) -> np.ndarray:
    masks = [np.unpackbits(np.frombuffer(bytes.fromhex(h), np.uint8), bitorder="little") for h in hexes]
    return np.stack([m[: heads * length].reshape(heads, length).astype(bool) for m in masks])


def as_mask(selection: torch.Tensor, length: int) -> np.ndarray:
    if selection.dtype == torch.bool:
        return selection.numpy()
    mask = np.zeros((selection.shape[0], length), dtype=bool)
    np.put_along_axis(mask, selection.numpy(), True, axis=1)
    return mask


def crosscheck(engine: Engine, python: str, length: int, max_new_tokens: int, pairs=PAIRS, ratios=RATIOS) -> dict:
    """Both sides on the needle prompt of ``length`` tokens; returns the comparison (``rows``, ``kvzip_scores``)."""
    task = get_task("needle")
    sample = build_samples(task, engine.tokenizer, TaskOptions(lengths=(length,), depths=(50,)))[0]
    prompt = kvpress_prompt(engine, sample, task.config["system"])
    presses = list(dict.fromkeys(pair.press for pair in pairs))
    theirs = run_kvpress(
        python,
        model_path(engine.loaded.name)[0],
        {**prompt, "max_new_tokens": max_new_tokens, "ratios": list(ratios), "presses": presses},
    )
    context_len = len(sample.context_ids)
    if theirs["context_tokens"] != context_len or not theirs["prompt_matches"]:
        raise click.ClickException("kvpress's tokens are not pkvbench's: the comparison would mean nothing")
    policies = {(p.spec, p.protocol): parse_policy(p.spec, protocol=p.protocol) for p in pairs}
    prefill = engine.prefill(torch.tensor([sample.context_ids]), list(policies.values()))
    stats = prefill.stats
    layers, heads = theirs["layers"], theirs["heads"]
    prefix, _ = chat_frame(engine.tokenizer, sample.context_ids)
    chunk = parse_policy("kvzip").chunk
    kvzip = np.stack([s.reconstruction_scores(chunk).numpy() for s in stats]) if stats[0].reconstruction else None
    context = {"prefix": prefix, "scores": [(-s.keys.float().norm(dim=-1)).numpy() for s in stats], "kvzip": kvzip}
    rows, requests = [], []
    for pair in pairs:
        policy = policies[pair.spec, pair.protocol]
        for ratio in ratios:
            budget = Budget.parse(f"cr{ratio}")
            _, chosen = engine.select(prefill, policy, budget)
            mine = np.stack(
                [
                    as_mask(chosen[layer], context_len) if layer in chosen else np.ones((heads, context_len), bool)
                    for layer in range(layers)
                ]
            )
            result = theirs["results"][f"{pair.press}@{ratio}"]
            kept = unpack(result["kept"], heads, context_len) if "kept" in result else None
            union = (mine | kept).sum() if kept is not None else 0
            rows.append(
                {
                    "policy": policy.label,
                    "protocol": pair.protocol,
                    "press": pair.press,
                    "ratio": ratio,
                    "expect": pair.expect,
                    "why": pair.why,
                    "holds": check(pair.expect, mine, kept, context),
                    "jaccard": None if kept is None else float((mine & kept).sum() / union),
                    "identical_heads": None if kept is None else float((mine == kept).all(axis=-1).mean()),
                    "kept_pkvbench": int(mine.sum()),
                    "kept_kvpress": None if kept is None else int(kept.sum()),
                    "answer_kvpress": result.get("answer"),
                    "error_kvpress": result.get("error") or result.get("answer_error"),
                }
            )
            cache = engine.compress(prefill, policy, budget)
            requests.append(engine.request(prefill, cache, max_new_tokens, question=sample.questions[0].ids))
    for row, decoded in zip(rows, engine.decode_many(requests)):
        row["answer_pkvbench"] = engine.tokenizer.decode(decoded.tokens, skip_special_tokens=True)
        row["answers_equal"] = row["answer_kvpress"] is not None and row["answer_pkvbench"] == row["answer_kvpress"]
    return {
        "rows": rows,
        "context_tokens": context_len,
        "prefix": prefix,
        "prefix_text": engine.tokenizer.decode(sample.context_ids[:prefix]),
        "system": task.config["system"],
        "kvzip": kvzip_comparison(stats, theirs, prefix) if theirs.get("kvzip_scores") else None,
        "versions": {k: theirs[k] for k in ("kvpress_version", "transformers_version", "torch_version")},
        "no_press_answer": theirs["results"]["no_press"].get("answer"),
    }


def kvzip_comparison(stats, theirs: dict, prefix: int) -> dict:
    """KVzip's scores on both sides over the positions both score (past the chat prefix)."""
    layers, heads = theirs["layers"], theirs["heads"]
    raw = np.frombuffer(base64.b64decode(theirs["kvzip_scores"]), np.float32).reshape(layers, heads, -1)
    chunk = parse_policy("kvzip").chunk
    mine = np.stack([s.reconstruction_scores(chunk).numpy() for s in stats])[..., prefix:]
    raw = raw[..., prefix:]
    return {
        "identical": bool(np.array_equal(mine, raw)),
        "max_abs_difference": float(np.abs(mine - raw).max()),
        "max_relative_difference": float((np.abs(mine - raw) / np.maximum(np.abs(raw), 1e-30)).max()),
        "mine": mine,
        "theirs": raw,
    }


def markdown(result: dict, command: str) -> str:
    def number(x, digits=3):
        return "" if x is None else f"{x:.{digits}f}"

    rows = result["rows"]
    by_pair: dict[tuple, list] = {}
    for row in rows:
        by_pair.setdefault((row["policy"], row["press"], row["protocol"]), []).append(row)
    ratios = sorted({row["ratio"] for row in rows})
    lines = [
        "| pkvbench policy | kvpress press | expected | holds | "
        + " | ".join(f"Jaccard {r:g} | identical heads {r:g}" for r in ratios)
        + " | why |",
        "|---|---|---|---|" + "---:|---:|" * len(ratios) + "---|",
    ]
    for (policy, press, protocol), cells in by_pair.items():
        first = cells[0]
        holds = "yes" if all(c["holds"] for c in cells) else "**no**"
        values = " | ".join(f"{number(c['jaccard'])} | {number(c['identical_heads'])}" for c in cells)
        label = f"`{policy}`" + (" (default)" if protocol == "exact" else "")
        lines.append(f"| {label} | {press} | {first['expect']} | {holds} | {values} | {first['why']} |")
    details = [
        "| pkvbench policy | press | ratio | kept, pkvbench | kept, kvpress | answers equal | pkvbench's answer | "
        "kvpress's answer |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        label = f"`{row['policy']}`" + (" (default)" if row["protocol"] == "exact" else "")
        theirs = row["answer_kvpress"] if row["error_kvpress"] is None else f"error: {row['error_kvpress']}"
        details.append(
            f"| {label} | {row['press']} | {row['ratio']:g} | {row['kept_pkvbench']} | "
            f"{'' if row['kept_kvpress'] is None else row['kept_kvpress']} | {'yes' if row['answers_equal'] else 'no'} | "
            f"{_cell(row['answer_pkvbench'])} | {_cell(theirs)} |"
        )
    kvzip = result["kvzip"]
    versions = result["versions"]
    kvzip_line = (
        "KVzip's scores past the chat prefix: "
        + ("bit-identical" if kvzip["identical"] else "not bit-identical")
        + f" (largest difference {kvzip['max_abs_difference']:.3g}, relative {kvzip['max_relative_difference']:.3g})."
        if kvzip
        else "KVzip was not compared."
    )
    return "\n".join(
        [
            "# pkvbench's policies against kvpress's presses",
            "",
            "Written by `scripts/kvpress_crosscheck.py`; do not edit by hand. Made with:",
            "",
            "```bash",
            "bash scripts/kvpress_env.sh                  # kvpress's own environment, .venv-kvpress",
            command,
            "```",
            "",
            f"kvpress {versions['kvpress_version']} (transformers {versions['transformers_version']}, torch "
            f"{versions['torch_version']}) and pkvbench on the same prompt: the needle task's, "
            f"{result['context_tokens']} context tokens with the task's system message (chat prefix "
            f"{result['prefix']} tokens), the question after compression as kvpress asks it; kvpress's tokens "
            "checked equal to pkvbench's, both on pkvbench's float32 copy of SmolLM2-135M-Instruct on the CPU. "
            "pkvbench's policies run with the `kvpress` preset (`--protocol kvpress`) unless marked (default). For "
            "each pair and compression ratio r (pkvbench's budget `cr<r>`), the kept (layer, KV head, position) "
            "entries are compared: the Jaccard index of the two sets, the fraction of (layer, head) sets that are "
            "identical, the counts, and the answers (greedy, question after compression).",
            "",
            "*expected* is what the pair must show, checked by the script: *identical* sets; *nested* (per layer "
            "and head one set within the other: same ranking, other counts); *kvpress within* (kvpress's set a "
            "subset of pkvbench's in every head); *equal scores* (the sets differ only among equal scores); "
            "*layer 0* (the same draw in layer 0 only); *kvzip* (past the chat prefix one set within the other "
            "over all layers and heads, pkvbench keeping the prefix); *kvpress fails*.",
            "",
            kvzip_line,
            "",
            "\n".join(lines),
            "",
            f"The full cache answers: {_cell(result['no_press_answer'])}",
            "",
            "\n".join(details),
            "",
        ]
    )


def _cell(text: str | None) -> str:
    return "" if text is None else text.replace("|", "\\|").replace("\n", " ").strip()


@click.command()
@click.option("--kvpress-python", required=True, help="A Python with kvpress installed (scripts/kvpress_env.sh).")
@click.option("--length", default=1200, show_default=True, help="Needle prompt length in tokens.")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--out", default="docs/kvpress-crosscheck.md", show_default=True, type=click.Path(dir_okay=False))
def main(kvpress_python, length, max_new_tokens, out):
    engine = Engine(load_model())
    result = crosscheck(engine, kvpress_python, length, max_new_tokens)
    command = (
        f".venv/bin/python scripts/kvpress_crosscheck.py --kvpress-python {kvpress_python} --length {length} "
        f"--max-new-tokens {max_new_tokens} --out {out}"
    )
    atomic_write(Path(out), markdown(result, command))
    failed = [f"{r['policy']} vs {r['press']} at {r['ratio']}" for r in result["rows"] if not r["holds"]]
    click.echo(f"{len(result['rows'])} comparisons → {out}; expectation failed: {', '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
