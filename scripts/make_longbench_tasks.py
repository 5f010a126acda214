#!/usr/bin/env python
"""Write tasks/longbench/*.yaml from LongBench's official config (dataset2prompt.json, dataset2maxlen.json) and
checksum list (SHA256SUMS).

    .venv/bin/python scripts/make_longbench_tasks.py [--source ../shared/data/longbench] [--check]

Prompt templates are written as YAML double-quoted strings and read back before anything is written: every
character, typos and trailing spaces included, must survive the round trip (scores depend on them). ``--check``
only compares what would be written with what is there (exit 1 on a difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tasks" / "longbench"

# name: (metric, language, description), in the official order (LongBench's pred.py).
DATASETS = {
    "narrativeqa": ("qa_f1", "en", "single-doc QA over a book or film script"),
    "qasper": ("qa_f1", "en", "single-doc QA over an NLP paper"),
    "multifieldqa_en": ("qa_f1", "en", "single-doc QA over documents of many fields"),
    "multifieldqa_zh": ("qa_f1_zh", "zh", "single-doc QA over documents of many fields (Chinese)"),
    "hotpotqa": ("qa_f1", "en", "multi-doc multi-hop QA over Wikipedia passages"),
    "2wikimqa": ("qa_f1", "en", "multi-doc multi-hop QA over Wikipedia passages (2WikiMultihopQA)"),
    "musique": ("qa_f1", "en", "multi-doc multi-hop QA (MuSiQue)"),
    "dureader": ("rouge_zh", "zh", "multi-doc QA over web search results (Chinese)"),
    "gov_report": ("rouge", "en", "summarise a government report"),
    "qmsum": ("rouge", "en", "query-based meeting summarisation"),
    "multi_news": ("rouge", "en", "multi-document news summarisation"),
    "vcsum": ("rouge_zh", "zh", "meeting summarisation (Chinese)"),
    "trec": ("classification", "en", "few-shot question-type classification"),
    "triviaqa": ("qa_f1", "en", "few-shot reading-comprehension QA"),
    "samsum": ("rouge", "en", "few-shot dialogue summarisation"),
    "lsht": ("classification", "zh", "few-shot news classification (Chinese)"),
    "passage_count": ("count", "en", "count the unique passages among shuffled duplicates"),
    "passage_retrieval_en": ("retrieval", "en", "find the paragraph an abstract was written from"),
    "passage_retrieval_zh": ("retrieval_zh", "zh", "find the paragraph an abstract was written from (Chinese)"),
    "lcc": ("code_sim", "code", "complete the next line of code"),
    "repobench-p": ("code_sim", "code", "complete the next line of code, with cross-file context"),
}
# LongBench-E: the same datasets re-sampled evenly over lengths, scored also per 0-4k / 4-8k / 8k+ bucket.
E_DATASETS = [
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]
# The 16 English and code datasets the PyramidKV paper reports.
PAPER = [
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]
# Official pred.py: these prompts go to the model without the chat template.
RAW_PROMPT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
# Official eval.py: these predictions are cut to their first line before scoring.
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}
# Official pred.py: samsum generation also stops at a newline.
STOP_AT_NEWLINE = {"samsum"}


class _Dumper(yaml.SafeDumper):
    pass


class Quoted(str):
    """A string written in YAML double quotes, escapes and all: nothing about it depends on YAML's plain rules."""


_Dumper.add_representer(Quoted, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style='"'))


def task_yaml(name: str, base: str, prompts: dict, maxlen: dict, sums: dict) -> str:
    metric, language, description = DATASETS[base]
    groups = (
        ["longbench-e"]
        if name.endswith("_e")
        else (["longbench"] if base in PAPER else []) + (["longbench-zh"] if language == "zh" else [])
    )
    spec = {
        "name": name,
        "version": 1,
        "description": f"LongBench{'-E' if name.endswith('_e') else ''}: {description}",
        "generator": "longbench",
        "metric": metric,
        "max_new_tokens": int(maxlen[base]),
        "chat_template": base not in RAW_PROMPT,
        "postprocess": ["first_line"] if base in FIRST_LINE else [],
        "stop_strings": [Quoted("\n")] if base in STOP_AT_NEWLINE else [],
        # Official pred.py: samsum also has min_length = prompt + 1, so the first token is never the stop newline.
        **({"min_new_tokens": 1} if base in STOP_AT_NEWLINE else {}),
        "groups": groups,
        "dataset": name,
        "language": language,
        "sha256": sums.get(f"{name}.jsonl"),
        "prompt": Quoted(prompts[base]),
        # Query-agnostic runs compress the prompt up to the end of {context} and add the rest afterwards.
        "question_part": (
            "the template after {context}: the question ({input}) and the answer instruction"
            if "{input}" in prompts[base].split("{context}", 1)[1]
            else "the template after {context}: only the answer instruction (this dataset has no per-sample question)"
        ),
    }
    text = (
        "# Generated by scripts/make_longbench_tasks.py from LongBench's config/dataset2prompt.json,\n"
        "# config/dataset2maxlen.json and SHA256SUMS; do not edit by hand. The prompt is the official one verbatim.\n"
        + yaml.dump(spec, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 30)
    )
    back = yaml.safe_load(text)
    if back["prompt"] != prompts[base] or back["stop_strings"] != spec["stop_strings"] or back["name"] != name:
        raise SystemExit(f"{name}: the YAML does not read back to the official strings")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data" / "longbench")
    parser.add_argument("--check", action="store_true", help="Compare only; exit 1 if a file would change.")
    args = parser.parse_args()
    prompts = json.loads((args.source / "config" / "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads((args.source / "config" / "dataset2maxlen.json").read_text(encoding="utf-8"))
    sums = {}
    for line in (args.source / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, filename = line.split()
            sums[filename.lstrip("*")] = digest
    if set(prompts) != set(DATASETS) or set(maxlen) != set(DATASETS):
        raise SystemExit(f"the official config names other datasets: {sorted(set(prompts) ^ set(DATASETS))}")
    files = {}
    for index, base in enumerate(DATASETS):
        files[f"{index:02d}-{base}.yaml"] = task_yaml(base, base, prompts, maxlen, sums)
    for index, base in enumerate(E_DATASETS):
        files[f"e/{index:02d}-{base}_e.yaml"] = task_yaml(f"{base}_e", base, prompts, maxlen, sums)
    changed = [
        path
        for path, text in files.items()
        if not (OUT / path).is_file() or (OUT / path).read_text(encoding="utf-8") != text
    ]
    if args.check:
        print("\n".join(changed) or "up to date")
        sys.exit(1 if changed else 0)
    for path in changed:
        (OUT / path).parent.mkdir(parents=True, exist_ok=True)
        (OUT / path).write_text(files[path], encoding="utf-8")
    print(f"{len(changed)} of {len(files)} task files written under {OUT}")


if __name__ == "__main__":
    main()
