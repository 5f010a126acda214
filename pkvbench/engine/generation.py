"""Prefill once, derive each policy's compressed cache by gathering, decode greedily.

The protocol is the paper's: the prefill attends over the full prompt; at its end each layer's cache is cut to the
entries the policy keeps (per KV head); decoding appends new entries and evicts nothing. New tokens take their
original positions T, T+1, ... whatever the compressed cache's length.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass

import torch

from pkvbench import budgets
from pkvbench.engine.attention import Recorder, StatsRecorder, recording
from pkvbench.engine.cache import decoding_cache
from pkvbench.engine.models import LoadedModel
from pkvbench.errors import PkvError
from pkvbench.policies.base import LayerStats, Needs, Policy


@dataclass
class Prefill:
    """The full cache and statistics of one prompt, shared by every policy × budget run on it."""

    input_ids: torch.Tensor  # [1, T]
    keys: list[torch.Tensor]  # per layer [1, Hkv, T, D]
    values: list[torch.Tensor]
    stats: list[LayerStats]
    last_logits: torch.Tensor  # [vocab] after the prompt: the prefill saw the full cache, so it is the same for all
    seconds: float

    @property
    def context_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def first_token(self) -> int:
        return int(self.last_logits.argmax())


@dataclass
class CompressedCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    plan: budgets.LayerPlan

    @property
    def kept_per_layer(self) -> list[int]:
        return [k.shape[2] for k in self.keys]

    @property
    def nbytes(self) -> int:
        """Physical bytes of the stored keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class Decoded:
    tokens: list[int]
    text: str
    seconds: float


class Engine:
    """Runs prompts through one loaded model."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(loaded.device)
        # transformers renamed the model's ``past_key_values`` argument to ``cache``; speak whichever it knows.
        forward_params = inspect.signature(self.model.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return ids

    def _forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=cache is not None,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return out.logits[0, -1]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, policies: list[Policy]) -> Prefill:
        """One forward pass over the prompt with the full cache, recording what ``policies`` need."""
        from transformers import DynamicCache

        input_ids = input_ids.to(self.device)
        length = input_ids.shape[1]
        recorder = StatsRecorder(Needs.union(p.needs for p in policies))
        cache = DynamicCache()
        logits, seconds = self.recorded_forward(input_ids, recorder, cache)
        layers = [cache.layers[i] for i in range(self.loaded.num_layers)]
        stats = [
            dataclasses.replace(
                recorder.layers.get(i, LayerStats(context_len=length, num_kv_heads=self.loaded.num_kv_heads)),
                keys=layer.keys[0],
                values=layer.values[0],
            )
            for i, layer in enumerate(layers)
        ]
        return Prefill(
            input_ids=input_ids,
            keys=[layer.keys for layer in layers],
            values=[layer.values for layer in layers],
            stats=stats,
            last_logits=logits,
            seconds=seconds,
        )

    @torch.inference_mode()
    def recorded_forward(self, input_ids: torch.Tensor, recorder: Recorder, cache=None) -> tuple[torch.Tensor, float]:
        """The prompt's forward pass with ``recorder`` seeing every layer's queries and keys; returns the last
        position's logits and the seconds taken. ``cache`` (if given) is filled with the full cache."""
        input_ids = input_ids.to(self.device)
        length = input_ids.shape[1]
        sliding = getattr(self.model.config, "sliding_window", None)
        if sliding and getattr(self.model.config, "use_sliding_window", True) and length > sliding:
            raise PkvError(f"prompt of {length} tokens exceeds the model's sliding window ({sliding}); not supported")
        started = time.perf_counter()
        with recording(recorder):
            logits = self._forward(input_ids, cache, torch.arange(length, device=self.device)[None])
        self._sync()
        return logits, time.perf_counter() - started

    def compress(self, prefill: Prefill, policy: Policy, budget: budgets.Budget) -> CompressedCache:
        """Gather the entries ``policy`` keeps at ``budget`` from the full cache (no second forward pass)."""
        plan = budgets.plan(policy, budget, prefill.context_len, self.loaded.num_layers)
        if not plan.compressed:
            return CompressedCache(keys=prefill.keys, values=prefill.values, plan=plan)
        keys, values = [], []
        for layer, k in enumerate(plan.per_layer):
            full_k, full_v = prefill.keys[layer], prefill.values[layer]
            if k >= prefill.context_len:
                keys.append(full_k)
                values.append(full_v)
                continue
            kept = policy.select(prefill.stats[layer], k).to(self.device)
            index = kept[None, :, :, None].expand(1, -1, -1, full_k.shape[-1])
            keys.append(full_k.gather(2, index))
            values.append(full_v.gather(2, index))
        return CompressedCache(keys=keys, values=values, plan=plan)

    @torch.inference_mode()
    def decode(
        self,
        prefill: Prefill,
        cache: CompressedCache,
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        min_new_tokens: int = 0,
    ) -> Decoded:
        """Greedy decoding from the compressed cache, at the original positions.

        Stops after an end-of-sequence token, once the text holds a stop string, or at ``max_new_tokens``. For the
        first ``min_new_tokens`` tokens the end tokens and the stop strings' tokens cannot be chosen (transformers'
        ``min_length``, which LongBench's samsum uses so that an answer never starts with its stop newline).
        """
        started = time.perf_counter()
        live = decoding_cache(cache.keys, cache.values, room=max_new_tokens)
        barred = sorted(self.stop_ids | self._last_token_ids(stop_strings)) if min_new_tokens else []
        tokens = [self._greedy(prefill.last_logits, barred)]
        position = prefill.context_len
        while len(tokens) < max_new_tokens and tokens[-1] not in self.stop_ids:
            if stop_strings and any(s in self.tokenizer.decode(tokens) for s in stop_strings):
                break
            step = torch.tensor([[tokens[-1]]], device=self.device)
            logits = self._forward(step, live, torch.tensor([[position]], device=self.device))
            tokens.append(self._greedy(logits, barred if len(tokens) < min_new_tokens else []))
            position += 1
        self._sync()
        seconds = time.perf_counter() - started
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Decoded(tokens=tokens, text=text, seconds=seconds)

    @staticmethod
    def _greedy(logits: torch.Tensor, barred: list[int]) -> int:
        if barred:
            logits = logits.clone()
            logits[barred] = float("-inf")
        return int(logits.argmax())

    def _last_token_ids(self, strings: tuple[str, ...]) -> set[int]:
        """The token each stop string ends with (how LongBench's pred.py turns "\n" into a stop id)."""
        return {self.tokenizer.encode(s, add_special_tokens=False)[-1] for s in strings}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
