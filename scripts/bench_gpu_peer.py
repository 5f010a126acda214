"""The GPU benchmark's peer row: NVIDIA kvpress's pipeline on the grid's cells, one call per configuration; one JSON
object on stdout's last line. ``scripts/bench_gpu.py`` runs it in a process of its own (importing kvpress patches
transformers' attention functions for the whole process) with kvpress on ``PYTHONPATH``:

    python scripts/bench_gpu_peer.py --model llama-3.2-1b --device cuda --dtype bfloat16 --length 8192 --new-tokens 32

The model is ``bench_gpu.random_model``'s, the very weights the grid decoded with (same configuration, seed and
device), and the prompt the grid's (``bench_gpu.random_prompt``). kvpress compresses a context and then feeds a
question, so the context is the prompt but its last token and the question that token: the same tokens prefilled,
the same budgets kept (``kvpress_grid.ratio_for``), then ``--new-tokens`` greedy tokens. The pipeline gets the ids
as they are (its ``preprocess`` returns them: the synthetic tokenizer has no text for most ids), and its answer's ids
are read where it decodes them. The cells: no press (full), ``StreamingLLMPress``, ``ObservedAttentionPress`` (H2O;
kvpress runs it with eager attention, which returns the T×T weights it sums), ``SnapKVPress`` and ``PyramidKVPress``
at each of the grid's budgets.

kvpress 0.5.5 pins transformers < 5.3. Against transformers 5.3+ two shims, both here: its presses' hooks read the
attention call's ``past_key_values`` and ``cache_position``, which transformers now passes as ``cache`` and not at
all (``hook_kwargs`` hands them what they read, the positions from the cache's length after the call); and kvpress
imports ``fire`` only for a script's command line (an empty module stands in where it is not installed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import types

import torch
from bench_gpu import CONFIGS, GRID_BUDGETS, GRID_POLICIES, random_model, random_prompt, synthetic_tokenizer, timed


def import_kvpress():
    if importlib.util.find_spec("fire") is None:
        sys.modules["fire"] = types.ModuleType("fire")  # kvpress uses it for a script's command line only
    import kvpress

    return kvpress


def hook_kwargs(press):
    """``press`` with its forward hook given ``past_key_values`` and ``cache_position`` where transformers passes
    ``cache`` (5.3 onwards): kvpress 0.5.5's hooks read those two."""
    hook = press.forward_hook

    def forward_hook(module, inputs, kwargs, output):
        if "past_key_values" not in kwargs and "cache" in kwargs:
            cache, new = kwargs["cache"], kwargs["hidden_states"].shape[1]
            seen = cache.get_seq_length(module.layer_idx)  # after this call's update
            positions = torch.arange(seen - new, seen, device=kwargs["hidden_states"].device)
            kwargs = {**kwargs, "past_key_values": cache, "cache_position": positions}
        return hook(module, inputs, kwargs, output)

    press.forward_hook = forward_hook
    return press


def presses(kvpress, context_len: int) -> list[tuple[str, str, object]]:
    """(policy, budget label, press or None) per cell of the grid, in ``bench_gpu.grid_requests``' order."""
    kinds = {
        "streamingllm": kvpress.StreamingLLMPress,
        "h2o": kvpress.ObservedAttentionPress,
        "snapkv": kvpress.SnapKVPress,
        "pyramidkv": kvpress.PyramidKVPress,
    }
    from kvpress_grid import ratio_for  # the ratio that keeps exactly a budget's entries

    cells = []
    for policy in GRID_POLICIES:
        for budget in GRID_BUDGETS:
            press = None if policy == "full" else hook_kwargs(kinds[policy](ratio_for(budget, context_len)))
            cells.append((policy, budget, press))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a configuration in configs/gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--length", type=int, required=True, help="the grid's prompt length")
    parser.add_argument("--new-tokens", type=int, required=True)
    args = parser.parse_args()

    kvpress = import_kvpress()
    from transformers import pipeline
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # kvpress warns per call about settings it ignores
    model, _ = random_model(CONFIGS / f"{args.model}.json", args.device, getattr(torch, args.dtype))
    tokenizer = synthetic_tokenizer()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=args.device)
    ids = random_prompt(args.length, model.config.vocab_size)
    pipe.preprocess = lambda *_, **__: {"context_ids": ids[:, :-1], "questions_ids": [ids[:, -1:]]}
    answers = []  # the ids of each answer, where the pipeline decodes them into text
    decode = tokenizer.decode
    tokenizer.decode = lambda tokens, **kwargs: answers.append(tokens.tolist()) or decode(tokens, **kwargs)

    def call(press):
        return timed(args.device, lambda: pipe("", question="", press=press, max_new_tokens=args.new_tokens))[1]

    call(None)  # warm-up: the first call's kernel choices are not measured
    cells = []
    for policy, budget, press in presses(kvpress, ids.shape[1] - 1):
        # ObservedAttentionPress sums the attention weights, which only the eager kernel returns
        model.set_attn_implementation("eager" if policy == "h2o" else "sdpa")
        seconds = call(press)
        cells.append({"policy": policy, "budget": budget, "seconds": round(seconds, 4), "tokens": answers[-1]})
    versions = {name: importlib.metadata.version(name) for name in ("kvpress", "transformers")}
    print(json.dumps({"versions": versions, "cells": cells}))


if __name__ == "__main__":
    main()
