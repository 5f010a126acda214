"""What a hybrid model's cache holds at a prompt length: its attention layers' entries against its recurrent layers'
fixed state (docs/memory.md, "Hybrid models").

Builds each family's released configuration (transformers' config defaults) on the meta device — no weights, no
download — runs one token through it with the cache pkvbench prefills into (``recurrent.prefill_cache``) and reads
the cache as the engine reads a loaded model's (``Engine._measured_geometry``): per attention layer its heads and
key and value sizes, and the states' bytes in the dtypes the model keeps them. Prints, per prompt length, the bytes
of the full cache at 16 bits per value and the state's share.

    .venv/bin/python scripts/hybrid_memory.py                      # Qwen3-Next, Qwen3.5, Jamba, Kimi Linear at 1k, 4k, 128k
    .venv/bin/python scripts/hybrid_memory.py --family qwen3_next --lengths 1024,4096,131072
"""

from __future__ import annotations

import argparse
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pkvbench.cell.kv_formats import CacheGeometry
from pkvbench.engine.architecture import Architecture
from pkvbench.engine.recurrent import prefill_cache, state_bytes, states_of

FAMILIES = ("qwen3_next", "qwen3_5_text", "jamba", "kimi_linear")


def geometry_of(model_type: str) -> tuple[CacheGeometry, Architecture]:
    config = AutoConfig.for_model(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        architecture = Architecture.read(config, model_type)  # each attention layer's cache, as the probe reads it
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            cache = prefill_cache(model.config)
            model(torch.zeros((1, 1), dtype=torch.long), past_key_values=cache, use_cache=True)
    return CacheGeometry(architecture.cache_shapes, state_bytes(states_of(cache))), architecture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", help="a model_type (repeatable); default: " + ", ".join(FAMILIES))
    parser.add_argument("--lengths", default="1024,4096,131072", help="prompt lengths, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print("| family | layers: attention / state | length | entries (16 bits) | state | state's share |")
    print("|---|---|---:|---:|---:|---:|")
    for family in args.family or FAMILIES:
        geometry, architecture = geometry_of(family)
        kinds = f"{len(architecture.attention_layers)} / {len(architecture.state_layers)}"
        for length in lengths:
            entries = geometry.full_bytes(length) - geometry.state_bytes
            share = geometry.state_bytes / (entries + geometry.state_bytes)
            print(
                f"| `{family}` | {kinds} | {length} | {entries / 2**20:.1f} MiB | "
                f"{geometry.state_bytes / 2**20:.1f} MiB | {share:.0%} |"
            )


if __name__ == "__main__":
    main()
