"""One press of NVIDIA kvpress's leaderboard, run as kvpress's evaluation runs it; one JSON file of its answers.

Runs in kvpress's own environment (``scripts/kvpress_env.sh``) and never imports pkvbench. ``scripts/bench.py``
(the ``leaderboard`` row) writes the prompts and starts this script once per press and query mode, as kvpress's
``evaluation/leaderboard.sh`` starts ``evaluate.py`` (there once per press × ratio, four at a time on four GPUs; here
once per press, its ratios in turn, which spares kvpress three model loads per press):

    .venv-kvpress/bin/python scripts/kvpress_leaderboard.py --prompts PROMPTS.json --model FOLDER \
        --press snapkv --ratios 0.25,0.5,0.75,0.875 [--query-aware] --out RESULT.json

The press is built as kvpress's ``evaluation/evaluate_registry.py`` builds it (``PRESSES`` below). Each prompt × ratio
is one call of kvpress's ``kv-press-text-generation`` pipeline, as ``evaluate.py`` makes it: the context compressed,
then the question decoded greedily on top; with ``--query-aware`` the question is appended to the context and the
question left empty (``evaluate.py --query_aware``), so the chat template's closing tokens and the answer prefix are
all that follows the compressed cache.

The prompts file: a list of ``{"id", "context", "question", "answer_prefix", "system", "max_new_tokens",
"prompt_ids"}`` (``context`` without the chat template, which kvpress applies; ``prompt_ids`` pkvbench's whole prompt,
which kvpress's tokens are checked against). Output: the versions, the load time, and per prompt × ratio the answer,
the entries kept per layer (the mean over KV heads: a press that drops entries leaves them in the cache; a head-wise
one keeps the cache whole and records the masked entries in each attention module's ``masked_key_indices``), and the
call's seconds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress_grid import with_system_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
from transformers.utils import logging as transformers_logging

# As kvpress's evaluation/evaluate_registry.py names and builds them.
PRESSES = {
    "no_press": lambda: None,
    "snapkv": SnapKVPress,
    "streaming_llm": StreamingLLMPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
    "keydiff": KeyDiffPress,
    "expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
    "kvzip": KVzipPress,
}


def set_ratio(press, ratio: float) -> None:
    """As evaluate.py's ``_setup_press``: the ratio goes on the press (on the inner one through AdaKV's property)."""
    if press is not None:
        press.compression_ratio = ratio


def kept_per_layer(model, cache: DynamicCache) -> list[float]:
    """Entries each layer keeps per KV head, averaged over its heads: the cache's length less what is masked."""
    kept = []
    for layer_idx, layer in enumerate(model.model.layers):
        length = cache.get_seq_length(layer_idx)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        heads = model.config.num_key_value_heads
        dropped = 0 if masked is None else len(masked[2])
        kept.append(round(length - dropped / heads, 3))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--model", required=True, help="transformers model folder")
    parser.add_argument("--press", required=True, choices=sorted(PRESSES))
    parser.add_argument("--ratios", default="0.25,0.5,0.75,0.875", help="compression ratios, comma-separated")
    parser.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = time.perf_counter()

    transformers_logging.disable_progress_bar()
    prompts = json.loads(args.prompts.read_text())
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # pkvbench's "auto" dtype
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    systems = {p.get("system") for p in prompts}
    if len(systems) > 1:
        raise SystemExit("the prompts have different system messages; run them apart")
    if systems != {None}:
        with_system_prompt(tokenizer, systems.pop())
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)
    press = PRESSES[args.press]()
    ratios = [0.0] if press is None else [float(r) for r in args.ratios.split(",")]
    load_s = time.perf_counter() - started

    calls = []
    for prompt in prompts:
        context, question = prompt["context"], prompt["question"]
        if args.query_aware:
            context, question = context + question, ""
        tokens = pipe.preprocess(context, [question], prompt["answer_prefix"], tokenizer.model_max_length)
        ids = tokens["context_ids"][0].tolist() + tokens["questions_ids"][0][0].tolist()
        for ratio in ratios:
            set_ratio(press, ratio)
            cache = DynamicCache()
            call_started = time.perf_counter()
            with torch.inference_mode():
                answer = pipe(
                    context,
                    question=question,
                    answer_prefix=prompt["answer_prefix"],
                    press=press,
                    max_new_tokens=prompt["max_new_tokens"],
                    cache=cache,
                )["answer"]
            calls.append(
                {
                    "id": prompt["id"],
                    "ratio": ratio,
                    "answer": answer,
                    "kept": kept_per_layer(model, cache),
                    "context_tokens": tokens["context_ids"].shape[1],
                    "seconds": round(time.perf_counter() - call_started, 4),
                    "prompt_matches": ids == prompt["prompt_ids"],
                }
            )
    args.out.write_text(
        json.dumps(
            {
                "press": args.press,
                "press_repr": repr(press),
                "query_aware": args.query_aware,
                "kvpress_version": importlib.metadata.version("kvpress"),
                "transformers_version": importlib.metadata.version("transformers"),
                "device": device,
                "threads": torch.get_num_threads(),
                "load_s": round(load_s, 4),
                "calls": calls,
            }
        )
    )


if __name__ == "__main__":
    main()
