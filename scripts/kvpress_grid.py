"""NVIDIA kvpress on bench.py's needle prompt and a 9-configuration grid; one JSON object on stdout's last line.

Runs in kvpress's own environment (``scripts/kvpress_env.sh``) and never imports pkvbench: ``scripts/bench.py``
(``kvpress()``) writes the prompt to a JSON file and passes the model folder (pkvbench's float copy of the embedded
model, a plain transformers folder):

    .venv-kvpress/bin/python scripts/kvpress_grid.py --prompt PROMPT.json --model ~/.cache/pkvbench/models/NAME

The prompt file: ``context`` (the needle prompt's context as text: the haystack with the needle, without the chat
template), ``question`` (the text that follows it in the user message, leading blank line included), ``system`` (the
task's system prompt), ``prompt_ids`` (pkvbench's whole prompt, to check kvpress's tokens against),
``max_new_tokens``, ``budgets`` (entries kept per layer) and the presses' options (``snapkv``: ``window_size``,
``kernel_size``; ``streamingllm``: ``n_sink``).

Each configuration is one ``pipeline("kv-press-text-generation")`` call (context, question, press): kvpress applies the
chat template itself, prefills and compresses the context alone, then puts the question on top of the compressed
cache and decodes greedily — pkvbench's query-agnostic mode. kvpress's pipeline has no system prompt (SmolLM2's
template would then insert its own default one), so the tokenizer's ``apply_chat_template`` is wrapped to put the
task's system message first; ``prompt_matches`` reports whether kvpress's context + question tokens are then exactly
pkvbench's prompt.

The grid: no press (full cache), then SnapKVPress and StreamingLLMPress at each budget k. kvpress takes a
``compression_ratio`` r (the fraction of the context removed) and keeps ``int(L * (1 - r))`` of the L context entries
per layer, so k maps to r = 1 - (k + 0.5) / L, which keeps exactly k; a budget of at least L maps to r = 0 (no
compression), as pkvbench keeps everything then. ``kept`` in the output is what the cache held after each call.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path

import torch
from kvpress import SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
from transformers.utils import logging as transformers_logging


def ratio_for(kept: int, context_len: int) -> float:
    """The compression ratio at which kvpress keeps ``kept`` of ``context_len`` entries (0: keep them all)."""
    return 0.0 if kept >= context_len else 1 - (kept + 0.5) / context_len


def with_system_prompt(tokenizer, system: str) -> None:
    """Make the pipeline's one-message chat (the user's) start with ``system``, as pkvbench's needle prompt does."""
    render = tokenizer.apply_chat_template

    def apply_chat_template(conversation, *args, **kwargs):
        return render([{"role": "system", "content": system}, *conversation], *args, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", required=True, type=Path, help="JSON file written by bench.py's kvpress()")
    parser.add_argument("--model", required=True, help="transformers model folder (pkvbench's float copy)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--warmup", type=int, default=1, help="untimed full-cache calls before the grid")
    args = parser.parse_args()

    transformers_logging.disable_progress_bar()  # the weight-loading bar would fill stderr
    spec = json.loads(args.prompt.read_text())
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # pkvbench's "auto" dtype
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    if spec.get("system"):
        with_system_prompt(tokenizer, spec["system"])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)

    context, question, max_new_tokens = spec["context"], spec["question"], spec["max_new_tokens"]
    # The tokens kvpress will feed (its own preprocessing), to size the ratios and compare with pkvbench's prompt.
    tokens = pipe.preprocess(context, [question], answer_prefix="", max_context_length=tokenizer.model_max_length)
    context_ids = tokens["context_ids"][0].tolist()
    question_ids = tokens["questions_ids"][0][0].tolist()
    context_len = len(context_ids)

    configs = [("full", None, None)]
    for name, press in (("snapkv", SnapKVPress), ("streamingllm", StreamingLLMPress)):
        for budget in spec["budgets"]:
            configs.append((name, budget, press(compression_ratio=ratio_for(budget, context_len), **spec[name])))

    def call(press):
        cache = DynamicCache()
        started = time.perf_counter()
        answer = pipe(context, question=question, press=press, max_new_tokens=max_new_tokens, cache=cache)["answer"]
        return answer, time.perf_counter() - started, cache.get_seq_length()

    warmup_s = sum(call(None)[1] for _ in range(args.warmup))
    results = []
    for name, budget, press in configs:
        answer, seconds, kept = call(press)
        results.append(
            {
                "config": name if budget is None else f"{name}/{budget}",
                "policy": name,
                "budget": budget,
                "press": repr(press) if press is not None else None,
                "compression_ratio": None if press is None else press.compression_ratio,
                "kept": kept,
                "seconds": round(seconds, 4),
                "answer": answer,
            }
        )
    print(
        json.dumps(
            {
                "kvpress_version": importlib.metadata.version("kvpress"),
                "transformers_version": importlib.metadata.version("transformers"),
                "torch_version": torch.__version__,
                "device": device,
                "threads": torch.get_num_threads(),
                "model": args.model,
                "context_tokens": context_len,
                "question_tokens": len(question_ids),
                "prompt_matches": context_ids + question_ids == spec.get("prompt_ids"),
                "configs": len(results),
                "kvpress_s": round(sum(r["seconds"] for r in results), 4),
                "warmup_s": round(warmup_s, 4),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
