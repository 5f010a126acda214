"""NVIDIA kvpress's presses on one prompt: the positions each keeps, per layer and KV head, and its answer.

The kvpress half of ``scripts/kvpress_crosscheck.py`` (which writes the prompt file and compares with pkvbench). It runs
in kvpress's own environment (``scripts/kvpress_env.sh``) and never imports pkvbench:

    .venv-kvpress/bin/python scripts/kvpress_presses.py --prompt PROMPT.json --model ~/.cache/pkvbench/models/NAME \
        --out KEPT.json

The prompt file: ``context``, ``question`` and ``system`` as for ``scripts/kvpress_grid.py`` (the context as text
without the chat template, the question as the text after it in the user message, the system message),
``prompt_ids`` (pkvbench's whole prompt, checked against kvpress's tokens), ``max_new_tokens``, ``ratios`` (kvpress's
compression ratios) and ``presses`` (names from ``PRESSES`` below).

Each press × ratio runs as kvpress's ``kv-press-text-generation`` pipeline runs it, in its two steps: the context's
prefill through the press on a fresh ``DynamicCache``, then the question on top and greedy decoding (the pipeline's
``generate_answer``). The kept positions are read between the two, from what the press leaves behind: a press that
really drops entries leaves each layer's kept keys in the cache, matched bit for bit against the keys of a prefill
without a press; a head-wise press (AdaKV, CriticalAdaKV, KVzip) keeps every entry and records the ones it masks out in
each attention module's ``masked_key_indices``. KVzip's scores are taken as ``KVzipPress.compress_post`` receives them.
Where kvpress fails, the error is the result: in the compression (``error``) or in the decoding (``answer_error``; a
cache whose layers hold different numbers of entries, as PyramidKV's pyramid leaves, fails in transformers 5.2's
attention mask).

kvpress's pipeline has no system message (SmolLM2's template would insert its default one), so the pipeline's
tokenizer is made to put the prompt's system message first, as ``scripts/kvpress_grid.py`` does; ``KVzipPress`` reads
its own tokenizer from the model folder to find the chat prefix and the answer's opening, so it is handed that same
tokenizer: both then render the conversation the prompt was made from.

Output (``--out``): one JSON object with the versions, the token check, each layer's key count, KVzip's scores
(``[layers, heads, T]`` float32, base64) and per press × ratio the kept positions (per layer a ``[heads, T]`` bit mask,
``numpy.packbits`` little-endian, hex), the answer, the seconds, or the error kvpress raised.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.metadata
import json
import time
from pathlib import Path

import numpy as np
import torch
from kvpress import (
    AdaKVPress,
    ChunkKVPress,
    CriticalAdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses import kvzip_press
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
from transformers.utils import logging as transformers_logging

# kvpress's presses by name, with their defaults unless the name says otherwise (the names of kvpress's
# evaluation/evaluate_registry.py where it has them).
PRESSES = {
    "knorm": lambda: KnormPress(),
    "keydiff": lambda: KeyDiffPress(),
    "tova": lambda: TOVAPress(),
    "streaming_llm": lambda: StreamingLLMPress(),
    "expected_attention_alone": lambda: ExpectedAttentionPress(),
    "snapkv": lambda: SnapKVPress(),
    "pyramidkv": lambda: PyramidKVPress(),
    "random_seed0": lambda: RandomPress(seed=0),
    "adakv_snapkv": lambda: AdaKVPress(SnapKVPress()),
    "adakv_expected_attention": lambda: AdaKVPress(ExpectedAttentionPress()),
    "expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
    "critical_adakv_snapkv": lambda: CriticalAdaKVPress(SnapKVPress()),
    "critical_adakv_expected_attention": lambda: CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False)),
    "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(), chunk_length=20),
    "chunkkv_knorm": lambda: ChunkKVPress(press=KnormPress(), chunk_length=20),
    "kvzip": lambda: KVzipPress(),
}


def with_system_prompt(tokenizer, system: str) -> None:
    """Make every chat ``tokenizer`` renders start with ``system`` (kvpress's pipeline renders the user's alone)."""
    render = tokenizer.apply_chat_template

    def apply_chat_template(conversation, *args, **kwargs):
        return render([{"role": "system", "content": system}, *conversation], *args, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template


class SameTokenizer:
    """Stands for ``AutoTokenizer`` inside ``kvzip_press``: hands KVzipPress the pipeline's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def from_pretrained(self, *args, **kwargs):
        return self.tokenizer


def row_hashes(keys: torch.Tensor) -> torch.Tensor:
    """``[heads, n]`` int64 fingerprints of the key vectors ``[heads, n, d]`` (their bits, weighted)."""
    bits = keys.float().contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, keys.shape[-1] + 1, dtype=torch.int64) * 2654435761
    return (bits * weights).sum(dim=-1)


def kept_from_keys(full: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """``[heads, T]`` bool: which of the ``full`` keys ``[heads, T, d]`` are in ``kept`` ``[heads, n, d]``."""
    heads, length, _ = full.shape
    mask = np.zeros((heads, length), dtype=bool)
    full_hashes, kept_hashes = row_hashes(full), row_hashes(kept)
    for head in range(heads):
        where = {int(h): p for p, h in enumerate(full_hashes[head].tolist())}
        for row, fingerprint in enumerate(kept_hashes[head].tolist()):
            position = where[fingerprint]
            if not torch.equal(full[head, position], kept[head, row]):
                raise RuntimeError(f"key of head {head} row {row} matches no key of the full cache bit for bit")
            mask[head, position] = True
    return mask


def kept_from_masks(model, length: int) -> list[np.ndarray] | None:
    """Per layer ``[heads, T]`` bool from the modules' ``masked_key_indices`` (head-wise presses), or None."""
    layers = [layer.self_attn for layer in model.model.layers]
    if all(getattr(module, "masked_key_indices", None) is None for module in layers):
        return None
    heads = model.config.num_key_value_heads
    kept = []
    for module in layers:
        mask = np.ones((heads, length), dtype=bool)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            _, head_index, position = masked
            mask[head_index.cpu().numpy(), position.cpu().numpy()] = False
        kept.append(mask)
    return kept


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def packed(mask: np.ndarray) -> str:
    return np.packbits(mask, bitorder="little").tobytes().hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", required=True, type=Path, help="JSON file written by kvpress_crosscheck.py")
    parser.add_argument("--model", required=True, help="transformers model folder (pkvbench's float copy)")
    parser.add_argument("--out", required=True, type=Path, help="where the JSON result goes")
    args = parser.parse_args()

    transformers_logging.disable_progress_bar()
    spec = json.loads(args.prompt.read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    if spec.get("system"):
        with_system_prompt(tokenizer, spec["system"])
    kvzip_press.AutoTokenizer = SameTokenizer(tokenizer)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context, question, max_new_tokens = spec["context"], spec["question"], spec["max_new_tokens"]
    tokens = pipe.preprocess(context, [question], answer_prefix="", max_context_length=tokenizer.model_max_length)
    context_ids = tokens["context_ids"][0].tolist()
    question_ids = tokens["questions_ids"][0][0].tolist()
    length = len(context_ids)

    def compress(press) -> DynamicCache:
        """The pipeline's prefill: the context alone, through the press (``KVPressTextGenerationPipeline._forward``)."""
        cache = DynamicCache()
        # Under no_grad, as a pipeline runs its forward: without it autograd keeps every activation (GBs, and slow).
        with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=torch.tensor([context_ids]), past_key_values=cache)
        return cache

    def answer(cache) -> dict:
        """The pipeline's decoding on ``cache``: the question on top, greedy (``generate_answer``), or its error."""
        try:
            ids = torch.tensor([question_ids])
            return {"answer": pipe.generate_answer(ids, cache, context_length=length, max_new_tokens=max_new_tokens)}
        except Exception as exc:  # kvpress's own failure is a result of the comparison
            return {"answer_error": describe(exc)}

    full_cache = compress(None)
    full_keys = [layer.keys[0].clone() for layer in full_cache.layers]
    results = {"no_press": answer(full_cache)}
    kvzip_scores = None
    for name in spec["presses"]:
        for ratio in spec["ratios"]:
            press = PRESSES[name]()
            press.compression_ratio = ratio
            if isinstance(press, KVzipPress):
                finish = press.compress_post

                def keep_scores(model, finish=finish, press=press):
                    nonlocal kvzip_scores
                    # [layers, heads, T], before the sinks' bonus
                    kvzip_scores = press.score_val[:, 0].detach().float().clone()
                    return finish(model)

                press.compress_post = keep_scores
            key = f"{name}@{ratio}"
            started = time.perf_counter()
            try:
                cache = compress(press)
            except Exception as exc:  # kvpress's own failure is a result of the comparison
                results[key] = {"error": describe(exc)}
                continue
            seconds = time.perf_counter() - started
            kept = kept_from_masks(model, length)
            if kept is None:
                kept = [kept_from_keys(full, layer.keys[0]) for full, layer in zip(full_keys, cache.layers)]
            results[key] = {"seconds": round(seconds, 3), "kept": [packed(m) for m in kept], **answer(cache)}
    out = {
        "kvpress_version": importlib.metadata.version("kvpress"),
        "transformers_version": importlib.metadata.version("transformers"),
        "torch_version": torch.__version__,
        "context_tokens": length,
        "prompt_matches": context_ids + question_ids == spec.get("prompt_ids"),
        "layers": len(full_keys),
        "heads": int(full_keys[0].shape[0]),
        "kvzip_scores": None if kvzip_scores is None else base64.b64encode(kvzip_scores.numpy().tobytes()).decode(),
        "results": results,
    }
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
