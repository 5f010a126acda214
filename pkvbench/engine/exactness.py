"""What the engine's decoding must equal token for token, computed by the stock model alone.

- The full cache: the model's own greedy ``generate`` on the prompt.
- A compressed cache that drops the same prompt positions in every layer and head (StreamingLLM): the model decoding
  step by step over the *full* cache, with an attention mask hiding the dropped positions from the new tokens, at
  the original positions.

``tests/test_engine.py`` checks both on the embedded model, ``scripts/bench_gpu.py`` on a random model on the device.
"""

from __future__ import annotations

import contextlib
import inspect

import torch


@contextlib.contextmanager
def stock_attention(model, name: str | None = None):
    """Temporarily run ``model`` on a stock transformers kernel (no pkvbench wrapper): ``name``, else the one
    pkvbench wraps (sdpa, or eager for a soft-capped model or a family without sdpa: ``models.kernel_of_family``)."""
    from pkvbench.engine.attention import PREFIX

    ours = model.config._attn_implementation
    model.set_attn_implementation(name or ours.removeprefix(PREFIX))
    try:
        yield
    finally:
        model.set_attn_implementation(ours)


def generate_reference(model, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """The stock model's greedy continuation of ``input_ids`` ``[1, T]``."""
    with stock_attention(model), torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, input_ids.shape[1] :].tolist()


def masked_reference(
    model,
    keys,
    values,
    visible: torch.Tensor,
    first_token: int,
    new_tokens: int,
    stop_ids: set[int],
    kept_whole: tuple[str, ...] = (),
    states: dict | None = None,
) -> list[int]:
    """Greedy tokens after a prompt whose full cache is ``keys``/``values`` (per attention layer ``[1, Hkv, T, D]``)
    and, for a hybrid model, its recurrent layers' ``states`` (by model layer, ``recurrent.LayerState``), the new
    tokens seeing only the prompt positions where ``visible`` (``[T]``) is true, at positions T, T + 1, …

    ``kept_whole``: layer kinds whose layers keep every prompt entry (a mixed model's local layers, never
    compressed); their layers see the whole prompt under their own window while the others see ``visible``. The
    masks are 4-D, one per layer kind (a model of one kind takes its one): each kind's window applied as the model
    applies it while it generates (``Architecture.windows``: its masks', or its cache's where that keeps fewer)."""
    from pkvbench.engine.architecture import Architecture
    from pkvbench.engine.recurrent import filled_cache

    architecture = Architecture.of_model(model)  # read on pkvbench's kernel, before the stock one takes over
    length = visible.shape[0]
    device = keys[0].device
    # transformers renamed ``past_key_values`` to ``cache``; speak whichever this version knows (as the engine does).
    cache_arg = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    tokens = [first_token]
    with stock_attention(model), torch.inference_mode():
        cache = filled_cache(model.config, architecture.attention_layers, keys, values, states or {}, length)
        mask = visible.long().to(device)
        while len(tokens) < new_tokens and tokens[-1] not in stop_ids:
            mask = torch.cat([mask, torch.ones(1, dtype=torch.long, device=device)])
            position = length + len(tokens) - 1
            masks = _masks_by_kind(architecture, model.config, mask.bool(), position, kept_whole, model.dtype)
            step = model(
                input_ids=torch.tensor([[tokens[-1]]], device=device),
                attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
                position_ids=torch.tensor([[position]], device=device),
                use_cache=True,
                **{cache_arg: cache},
            )
            tokens.append(int(step.logits[0, -1].argmax()))
    return tokens


def _masks_by_kind(
    architecture, config, visible: torch.Tensor, position: int, kept_whole: tuple[str, ...], dtype: torch.dtype
) -> dict:
    """The one query's 4-D masks ``[1, 1, 1, position + 1]`` per layer kind: what it may see of the cache's entries
    (at positions 0 … position), a sliding kind within its window, a chunked kind within its chunk
    (``architecture``'s, read from the model); boolean, or added to the logits in ``dtype`` where the model runs the
    eager kernel (Gemma 2). A kind without attention takes none (a recurrent layer's padding mask: one new token is
    never padding)."""
    from pkvbench.engine.architecture import CHUNKED
    from pkvbench.engine.sliding import oldest_seen

    entries = torch.arange(position + 1, device=visible.device)
    masks = {}
    for layer, (kind, window) in enumerate(zip(architecture.layer_kinds, architecture.windows)):
        if architecture.attention_kind(layer) is None:
            masks[kind] = None
            continue
        seen = torch.ones_like(visible) if kind in kept_whole else visible
        if window is not None:
            seen = seen & (entries >= oldest_seen(position, window, kind == CHUNKED))
        masks[kind] = seen[None, None, None]
    if config._attn_implementation == "eager":  # the eager kernel adds its masks to the logits
        return {
            kind: m
            if m is None
            else torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
            for kind, m in masks.items()
        }
    return masks
