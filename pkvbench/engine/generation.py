"""Prefill once, derive each policy's compressed cache by gathering, decode greedily.

The protocol is the paper's: the prefill attends over the full prompt; at its end each layer's cache is cut to the
entries the policy keeps (per KV head); decoding appends new entries and evicts nothing. New tokens take their
original positions T, T+1, ... whatever the compressed cache's length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass

import numpy as np
import torch

from pkvbench.cell import budgets, kv_formats
from pkvbench.engine.architecture import Architecture, LayerSoftmax, Rotation
from pkvbench.engine.attention import Recorder, StatsRecorder, recording
from pkvbench.engine.decoding import BatchDecoder, Decoded, DecodeRequest, KeptEntries
from pkvbench.engine.latent import check_policies as check_latent_policies
from pkvbench.engine.latent import fold
from pkvbench.engine.models import LoadedModel, ModelShape
from pkvbench.engine.placement import cuda_devices, execution_device
from pkvbench.engine.quantized import StoredEntries
from pkvbench.engine.reconstruction import SINK, ReconstructionRecorder, repeat_inputs
from pkvbench.engine.recurrent import LayerState, filled_cache, prefill_cache, state_bytes, states_of
from pkvbench.engine.shrinking import DecodeSchedule, prefill_needs, start_from
from pkvbench.errors import PkvError, first_line
from pkvbench.policies.base import LayerStats, Needs, Policy


@dataclass
class Prefill:
    """The full cache and statistics of one prompt, shared by every policy × budget (× query mode) run on it.

    ``stats_at[c]`` are the statistics of the prompt's first c tokens alone (each layer's): those of the whole prompt
    (c = T) for the question inside the compressed prompt, those of the context (c = where it ends) for a question
    that comes after compression. Attention is causal, so the first c tokens' queries and keys — and statistics —
    are exactly what a prefill of those tokens alone would give.
    """

    input_ids: torch.Tensor  # [1, T]
    keys: list[torch.Tensor]  # per attention layer [1, Hkv, T, D]
    values: list[torch.Tensor]
    stats_at: dict[int, list[LayerStats]]  # per attention layer
    last_logits: torch.Tensor  # [vocab] after the prompt: the prefill saw the full cache, so it is the same for all
    seconds: float
    extra_seconds: float = 0.0  # passes some policies need beside the prefill (KVzip's repeat passes)
    # A hybrid model's recurrent layers' states after the prompt's first c tokens, for each c of ``stats_at``.
    states_at: dict[int, dict[int, LayerState]] = dataclasses.field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def stats(self) -> list[LayerStats]:
        """The whole prompt's statistics."""
        return self.stats_at[self.context_len]

    @property
    def first_token(self) -> int:
        return int(self.last_logits.argmax())


def ragged_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A keep mask ``[heads, T]`` → (each head's kept positions in order, padded to the fullest head by repeating its
    last position, ``[heads, n]``; each head's count, ``[heads]``)."""
    length = mask.shape[1]
    counts = mask.sum(dim=1)
    positions = torch.where(mask, torch.arange(length, device=mask.device), length).sort(dim=1).values
    positions = positions[:, : max(int(counts.max()), 1)]  # a layer may keep nothing (KVzip): one masked slot
    last = positions.gather(1, (counts - 1).clamp(min=0)[:, None]).clamp(max=length - 1)  # a head may keep none
    return torch.where(positions < length, positions, last), counts


# How PyTorch says an allocation failed: on the CPU a RuntimeError with one of these, on a GPU OutOfMemoryError.
OUT_OF_MEMORY = ("can't allocate memory", "not enough memory", "out of memory")


@contextlib.contextmanager
def too_big_for_memory(what: str, length: int):
    """A statistic that would allocate more than the machine (or the device) has: one line naming the length, not
    an internal error."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not any(marker in str(exc) for marker in OUT_OF_MEMORY):
            raise
        raise PkvError(
            f"{what} on a prompt of {length} tokens need more memory than is free: {first_line(exc)}"
        ) from None


@dataclass
class CompressedCache:
    """The entries one policy keeps at one budget, per layer ``[heads, n, dim]`` (batch dimension dropped), in the
    model's dtype (``KeptEntries``) or stored in fewer bits (``quantized.StoredEntries``)."""

    kept: KeptEntries | StoredEntries
    plan: budgets.LayerPlan
    # What the policy chose, per layer: kept indices ``[heads, k]``, a keep mask ``[heads, T]``, or None where the
    # layer keeps every entry; None for the whole cache when nothing was compressed.
    selected: list[torch.Tensor | None] | None = None

    def kept_positions(self) -> list[list[np.ndarray]]:
        """Each layer's and head's kept prompt positions, sorted (what the selection fingerprints hash)."""
        layers = []
        for layer, heads in enumerate(self.kept.heads):
            chosen = None if self.selected is None else self.selected[layer]
            if chosen is None:
                everything = np.arange(self.plan.context_len)
                layers.append([everything] * heads)
            elif chosen.dtype == torch.bool:
                layers.append([np.flatnonzero(row) for row in chosen.cpu().numpy()])
            else:
                layers.append([np.sort(row) for row in chosen.cpu().numpy()])
        return layers

    @property
    def kept_per_layer(self) -> list[int]:
        """Entries per cache head in each layer (the mean over heads where heads keep different numbers)."""
        if self.kept.lengths is None:
            return [k.shape[1] for k in self.kept.keys]
        return [round(float(n.float().mean()), 3) for n in self.kept.lengths]

    @property
    def nbytes(self) -> int:
        """Physical bytes of the stored keys and values (padding included)."""
        return self.kept.nbytes


def kept_bytes(kept: KeptEntries, fmt: kv_formats.KVFormat) -> int:
    """What ``kept`` will take once stored in ``fmt`` (``kv_formats.KVFormat.layer_bytes``, layer by layer), and its
    states (kept as they are)."""
    total = state_bytes(kept.states)
    for index, (keys, values) in enumerate(zip(kept.keys, kept.values)):
        lengths = kept.lengths[index].tolist() if kept.lengths is not None else [keys.shape[1]] * keys.shape[0]
        total += fmt.layer_bytes(keys.shape[0], keys.shape[-1], lengths, values.shape[-1])
    return total


class Engine:
    """Runs prompts through one loaded model."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.architecture = Architecture.of_model(loaded.model, loaded.name)
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(loaded.device)
        # transformers renamed the model's ``past_key_values`` argument to ``cache``; speak whichever it knows.
        forward_params = inspect.signature(self.model.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        self.stop_ids = self._stop_ids()
        # Where each layer's attention runs (accelerate's execution device where it placed the model): its cache,
        # statistics and decode-time state live there.
        self.layer_devices = [execution_device(m) for m in self.architecture.attention_modules(self.model)]
        self.geometry = self._measured_geometry()
        self.decoder = BatchDecoder(
            self._forward, self.tokenizer, self.stop_ids, self.device, self._sync, self.architecture, self.rope
        )

    @property
    def softmaxes(self) -> list[LayerSoftmax]:
        """Each layer's softmax (``architecture.LayerSoftmax``): what every recorder computes statistics with."""
        return list(self.architecture.softmaxes)

    @property
    def rotation(self) -> Rotation:
        return self.architecture.rotation

    @property
    def latent(self) -> bool:
        """Whether the model caches an MLA latent (``engine/latent.py``)."""
        return self.architecture.latent

    def check_policies(self, policies) -> None:
        """Refuse, in one line, a policy the model's cache cannot serve (an MLA model: ``latent.refusal``)."""
        if self.latent:
            check_latent_policies(policies, self.loaded.name)

    @torch.inference_mode()
    def _measured_geometry(self) -> kv_formats.CacheGeometry:
        """The cache's shape: each attention layer's as the model writes it (``Architecture.cache_shapes``, read by
        the probe), and the bytes of a hybrid model's states (whatever the prompt's length, in the dtypes the model
        keeps them), read off a one-token prefill."""
        layers = self.architecture.cache_shapes
        if not self.architecture.state_layers:
            return kv_formats.CacheGeometry(layers)
        cache = self.prefill_cache()
        token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._forward(token, cache, token)
        return kv_formats.CacheGeometry(layers, state_bytes(states_of(cache)))

    @property
    def shape(self) -> ModelShape:
        """The model's cache as loaded: what its layers do, the measured geometry (a hybrid's state)."""
        return ModelShape(self.geometry, self.architecture.query_heads, self.loaded.bits, self.architecture)

    def prefill_cache(self):
        """An empty cache for a prefill: transformers' ``DynamicCache``, with a hybrid model's state layers
        (``recurrent.prefill_cache``)."""
        from transformers import DynamicCache

        return prefill_cache(self.model.config) if self.architecture.state_layers else DynamicCache()

    @property
    def native_format(self) -> kv_formats.KVFormat:
        """The model's own cache: its dtype's width, stored as computed."""
        return kv_formats.KVFormat(self.model.dtype.itemsize * 8, native=True)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The 16 bits of a stored cache (scales, minima, residual): the model's dtype where it has 16 bits, else
        float16 (of the 16-bit formats, the one with the finer steps)."""
        return self.model.dtype if self.model.dtype.itemsize == 2 else torch.float16

    def rope(self, start: int, count: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s RoPE cos and sin ``[count, rotary width]`` (float32) at positions start, start + 1, …
        (``Architecture.rope``: Gemma 3's local and global layers rotate differently), paired as ``self.rotation``
        says."""
        positions = torch.arange(start, start + count, device=self.device)[None]
        embedding = self.architecture.rope(self.model, layer, torch.zeros(1, device=self.device), positions)
        cos, sin = self.rotation.tables(embedding, layer, count)
        # where the layer's queries are (``layer_devices``: per attention layer)
        device = self.layer_devices[self.architecture.attention_layers.index(layer)]
        return cos.to(device), sin.to(device)

    def _stop_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return ids

    def _forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor) -> torch.Tensor:
        """The model on ``input_ids`` ``[batch, n]``; the logits after each row's last token, ``[batch, vocab]``."""
        return self.logits(input_ids, cache, position_ids, keep=1)[:, -1]

    def logits(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The model on ``input_ids`` ``[batch, n]``; the logits after each row's last ``keep`` tokens,
        ``[batch, keep, vocab]``."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=cache is not None,
            logits_to_keep=keep,
            **{self._cache_arg: cache},
        )
        return out.logits[:, -keep:]

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        policies: list[Policy],
        cuts: tuple[int, ...] = (),
        decoding: list[Policy] = (),
    ) -> Prefill:
        """One forward pass over the prompt with the full cache, recording what ``policies`` need of the whole
        prompt, or of its first c tokens for each c in ``cuts``, and what ``decoding`` (policies that will cut the
        cache while the answer is written) start from."""
        input_ids = input_ids.to(self.device)
        cuts = tuple(sorted(set(cuts))) or (input_ids.shape[1],)
        needs = Needs.union([*(p.needs for p in policies), *(prefill_needs(p) for p in decoding)])
        recorder = StatsRecorder(needs, self.softmaxes, cuts, self.rope, self.rotation)
        cache = self.prefill_cache()
        with too_big_for_memory("the prefill's statistics", input_ids.shape[1]):
            logits, seconds = self.recorded_forward(input_ids, recorder, cache)
        attention = self.architecture.attention_layers
        layers = [cache.layers[i] for i in attention]
        states_at = self._states_at(input_ids, cuts, cache)
        started = time.perf_counter()
        reconstruction = {
            (cut, chunk): self.reconstruction_scores(layers, input_ids[0, :cut].tolist(), chunk, states_at[cut])
            for cut in cuts
            for chunk in needs.reconstruction
        }
        extra_seconds = time.perf_counter() - started
        stats_at = {
            cut: [
                dataclasses.replace(
                    recorder.layers.get((cut, model_layer), LayerStats(context_len=cut, num_kv_heads=shape.heads)),
                    num_kv_heads=shape.heads,  # a latent (MLA) cache's one "head": every query head in one group
                    num_query_heads=self.loaded.num_query_heads,
                    layer=i,
                    keys=layer.keys[0, :, :cut],
                    values=layer.values[0, :, :cut],
                    output_weight=self.architecture.output_weight(self.model, i) if needs.output_weights else None,
                    reconstruction={chunk: reconstruction[cut, chunk][i] for chunk in needs.reconstruction},
                )
                for i, (model_layer, layer, shape) in enumerate(zip(attention, layers, self.geometry.layers))
            ]
            for cut in cuts
        }
        return Prefill(
            input_ids=input_ids,
            keys=[layer.keys for layer in layers],
            values=[layer.values for layer in layers],
            stats_at=stats_at,
            last_logits=logits,
            seconds=seconds,
            extra_seconds=extra_seconds,
            states_at=states_at,
        )

    def _states_at(self, input_ids: torch.Tensor, cuts: tuple[int, ...], cache) -> dict[int, dict[int, LayerState]]:
        """A hybrid model's states after the prompt's first c tokens, for each cut c: the prefill's own for the whole
        prompt; for a shorter cut (the context, where the question comes after compression), a forward of those
        tokens alone, since a recurrent state holds no positions to cut back to. An attention-only model: none."""
        if not self.architecture.state_layers:
            return {cut: {} for cut in cuts}
        length = input_ids.shape[1]
        states = {}
        for cut in cuts:
            if cut == length:
                states[cut] = states_of(cache)
                continue
            own = self.prefill_cache()
            self._forward(input_ids[:, :cut], own, torch.arange(cut, device=self.device)[None])
            states[cut] = states_of(own)
        return states

    @torch.inference_mode()
    def reconstruction_scores(
        self, layers, prompt: list[int], chunk: int, states: dict | None = None, fused: bool = True
    ) -> list[torch.Tensor]:
        """KVzip's scores of the prompt's entries (``engine/reconstruction.py``): ``[num_kv_heads, len(prompt)]`` per
        attention layer, from repeat passes over the full cache ``layers`` (cut to the prompt; ``states``: a hybrid
        model's after the prompt). ``fused=False`` takes the unfused path everywhere (the model's kernel plus the
        recorder's own softmax; the fused path's reference)."""
        length = len(prompt)
        prefix, passes = repeat_inputs(self.tokenizer, prompt, chunk)
        # The fused path attends to the whole prompt: not for a sliding window or chunk shorter than a
        # pass's reach.
        sliding = self.architecture.prompt_window
        if sliding:
            fused = fused and all(length + len(ids) <= sliding for _, _, ids in passes)
        attention = self.architecture.attention_layers
        scores = [
            torch.zeros(shape.heads, length, device=layer.keys.device)
            for shape, layer in zip(self.geometry.layers, layers)
        ]
        for layer_scores in scores:  # the chat prefix and the sinks are always kept
            layer_scores[:, : max(prefix, min(SINK, length))] = float("inf")
        for start, end, ids in passes:
            cache = filled_cache(
                self.model.config,
                attention,
                [layer.keys[:, :, :length] for layer in layers],
                [layer.values[:, :, :length] for layer in layers],
                states or {},
                length,
            )
            recorder = ReconstructionRecorder(self.softmaxes, length, start, end, min(SINK, start), fused)
            positions = torch.arange(length, length + len(ids), device=self.device)[None]
            with recording(recorder):
                self._forward(torch.tensor([ids], device=self.device), cache, positions)
            for model_layer, layer_scores in zip(attention, scores):  # a latent's heads fold to its one
                layer_scores[:, start:end] = fold(recorder.scores[model_layer], layer_scores.shape[0])
        return scores

    @torch.inference_mode()
    def recorded_forward(self, input_ids: torch.Tensor, recorder: Recorder, cache=None) -> tuple[torch.Tensor, float]:
        """The prompt's forward pass with ``recorder`` seeing every layer's queries and keys; returns the last
        position's logits and the seconds taken. ``cache`` (if given) is filled with the full cache."""
        input_ids = input_ids.to(self.device)
        length = input_ids.shape[1]
        limit = self.architecture.prompt_limit
        if limit is not None and length > limit and recorder.needed and recorder.attends_over_prompt:
            raise PkvError(
                f"a prompt of {length} tokens exceeds the sliding window of {limit} tokens of every layer of "
                f"{self.loaded.name}, and these statistics assume every query sees the whole prompt"
            )
        started = time.perf_counter()
        with recording(recorder):
            logits = self._forward(input_ids, cache, torch.arange(length, device=self.device)[None])[0]
        self._sync()
        return logits, time.perf_counter() - started

    def select(
        self, prefill: Prefill, policy: Policy, budget: budgets.Budget, cut: int | None = None
    ) -> tuple[budgets.LayerPlan, dict[int, torch.Tensor]]:
        """What ``policy`` keeps at ``budget`` (in entries) of the whole prompt or of its first ``cut`` tokens: the
        layer plan and, for each layer it compresses, the selection (kept positions ``[heads, k]``, or a keep mask
        ``[heads, T]`` where heads keep different numbers of entries)."""
        self.check_policies([policy])
        plan = self._plan(policy, budget, cut or prefill.context_len)
        return plan, self._choose(prefill, policy, plan)

    def _plan(self, policy: Policy, budget: budgets.Budget, length: int) -> budgets.LayerPlan:
        return budgets.plan(policy, budget, length, self.geometry.num_layers, self.geometry.local)

    def _choose(self, prefill: Prefill, policy: Policy, plan: budgets.LayerPlan) -> dict[int, torch.Tensor]:
        """Each layer's selection under ``plan`` where the policy compresses it (a local layer keeps its window's
        entries whatever the policy: ``_gather``)."""
        length = plan.context_len
        local = self.geometry.local  # per attention layer, as ``plan.per_layer``
        compressed = [i for i, k in enumerate(plan.per_layer) if k < length and local[i] is None]
        if not compressed:
            return {}
        stats = prefill.stats_at[length]
        with too_big_for_memory(f"{policy.label}'s scores", length):
            kept = policy.select_layers([stats[i] for i in compressed], [plan.per_layer[i] for i in compressed])
        return dict(zip(compressed, kept))

    def compress(
        self,
        prefill: Prefill,
        policy: Policy,
        budget: budgets.Budget,
        cut: int | None = None,
        fmt: kv_formats.KVFormat | None = None,
    ) -> CompressedCache:
        """Gather the entries ``policy`` keeps at ``budget`` from the full cache (no second forward pass): of the
        whole prompt, or of its first ``cut`` tokens (the context, when the question comes after compression); then
        store them in ``fmt`` (default: the model's own cache). A memory budget keeps as many entries as fit its
        bytes in ``fmt`` (``kv_formats.memory_plan``)."""
        self.check_policies([policy])
        fmt = fmt or self.native_format
        length = cut or prefill.context_len
        heads = policy.query_sets(self.architecture.query_heads)
        if budget.memory:
            plan = kv_formats.memory_plan(policy, budget, length, self.geometry, fmt, heads)
        else:
            plan = self._plan(policy, budget, length)
        kept, selected = self._gather(prefill, policy, plan, heads)
        if budget.memory and kept.lengths is not None and kept_bytes(kept, fmt) > plan.target_bytes:
            plan, (kept, selected) = self._fit_head_wise(prefill, policy, budget, plan, heads, fmt)
        if not fmt.native:  # FP8 scales calculated from the prompt see every entry of it, as vLLM's do
            prompt = [(k[0, :, :length], v[0, :, :length]) for k, v in zip(prefill.keys, prefill.values)]
            kept = StoredEntries.store(kept, fmt, self.storage_dtype, prompt)
        return CompressedCache(kept, plan, selected)

    def _fit_head_wise(
        self,
        prefill: Prefill,
        policy: Policy,
        budget: budgets.Budget,
        plan: budgets.LayerPlan,
        heads: int | None,
        fmt: kv_formats.KVFormat,
    ) -> tuple[budgets.LayerPlan, tuple[KeptEntries, list | None]]:
        """A policy whose heads keep different numbers of entries is stored padded to each layer's fullest head:
        the bytes depend on what it selects. The most entries whose selection fits the memory budget."""
        length = plan.context_len
        tried: dict[int, tuple[budgets.LayerPlan, tuple[KeptEntries, list | None]]] = {}

        def fits(k: int) -> bool:
            per_layer = self.geometry.layer_budgets(policy, k, length)
            smaller = dataclasses.replace(plan, requested=k, effective=k, per_layer=per_layer)
            tried[k] = (smaller, self._gather(prefill, policy, smaller, heads))
            return kept_bytes(tried[k][1][0], fmt) <= plan.target_bytes

        floor = min(max(policy.min_budget, 1), length)
        k = kv_formats.largest(floor, plan.effective - 1, fits)
        if k is None:
            needed, full = kept_bytes(tried[floor][1][0], fmt), self.geometry.full_bytes(length)
            raise kv_formats.MemoryTooSmall(budget, needed, full, f"{policy.label} at {fmt} bits on {length} tokens")
        if k not in tried:
            fits(k)
        return tried[k]

    def _gather(
        self, prefill: Prefill, policy: Policy, plan: budgets.LayerPlan, heads: int | None
    ) -> tuple[KeptEntries, list[torch.Tensor | None] | None]:
        """The entries ``policy`` keeps under ``plan``, gathered from the full cache, and what it chose per layer
        (None where a layer keeps everything; None in all when nothing is compressed)."""
        length = plan.context_len
        chosen = self._choose(prefill, policy, plan)
        full_keys = [k[0, :, :length] for k in prefill.keys]
        full_values = [v[0, :, :length] for v in prefill.values]
        # One kept set per KV head, or (the reference's gqa=query: ``heads``) one per query head, from keys and
        # values repeated to every query head of their group as transformers' repeat_kv does.
        if heads is not None:
            full_keys = [k.repeat_interleave(heads // k.shape[0], dim=0) for k in full_keys]
            full_values = [v.repeat_interleave(heads // v.shape[0], dim=0) for v in full_values]
        states = prefill.states_at[length]
        if not plan.compressed:
            return KeptEntries(full_keys, full_values, states=states), None
        keys, values, positions = [], [], []
        lengths: list[torch.Tensor | None] = [None] * len(plan.per_layer)
        selected: list[torch.Tensor | None] = [None] * len(plan.per_layer)
        for layer, budget in enumerate(plan.per_layer):
            device = full_keys[layer].device  # the layer's: its kept indices move there, never its entries
            if layer not in chosen and budget < length:  # a local layer: the last entries its window still sees
                recent = torch.arange(length - budget, length, device=device)
                chosen[layer] = recent.expand(full_keys[layer].shape[0], -1)
            if layer not in chosen:
                keys.append(full_keys[layer])
                values.append(full_values[layer])
                positions.append(torch.arange(length, device=device).expand(full_keys[layer].shape[0], -1))
                continue
            kept = selected[layer] = chosen[layer].to(device)
            if kept.dtype == torch.bool:  # heads keep different numbers of entries: stored padded, counted apart
                kept, lengths[layer] = ragged_positions(kept)
            index = kept[:, :, None]  # a latent cache's keys and values differ in size
            keys.append(full_keys[layer].gather(1, index.expand(-1, -1, full_keys[layer].shape[-1])))
            values.append(full_values[layer].gather(1, index.expand(-1, -1, full_values[layer].shape[-1])))
            positions.append(kept)
        if not any(n is not None for n in lengths):
            return KeptEntries(keys, values, positions=positions, states=states), selected
        filled = [n if n is not None else torch.full((k.shape[0],), k.shape[1]) for n, k in zip(lengths, keys)]
        return KeptEntries(keys, values, filled, positions, states), selected

    def request(
        self,
        prefill: Prefill,
        cache: CompressedCache,
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        min_new_tokens: int = 0,
        question: list[int] | None = None,
        schedule: DecodeSchedule | None = None,
    ) -> DecodeRequest:
        """Decode ``cache``: after the prefilled prompt (the question was part of the compressed prompt), or, with
        ``question``, after feeding the question's tokens on top of the compressed context (the cache's first
        ``cache.plan.context_len`` prompt tokens) at their original positions; they are never compressed by the
        prefill budget. With ``schedule`` the cache is cut while the answer is written (``engine/shrinking.py``)."""
        sequence = prefill.context_len if question is None else cache.plan.context_len + len(question)
        self.architecture.check_rope(sequence, max_new_tokens, self.loaded.name)
        common = {
            "kept": cache.kept,
            "max_new_tokens": max_new_tokens,
            "stop_strings": tuple(stop_strings),
            "min_new_tokens": min_new_tokens,
        }
        if schedule is not None:
            length = cache.plan.context_len
            kept = cache.kept.positions or [
                torch.arange(length, device=k.device).expand(k.shape[0], -1) for k in cache.kept.keys
            ]
            common["schedule"] = schedule
            common["start"] = start_from(prefill.stats_at[length], kept, schedule.needs)
        if question is None:
            return DecodeRequest(position=prefill.context_len, first_logits=prefill.last_logits, **common)
        return DecodeRequest(position=cache.plan.context_len, feed=tuple(question), **common)

    def schedule(self, policy: Policy, target: int | None, interval: int, buffer: int) -> DecodeSchedule | None:
        """The decode-time schedule of ``policy`` at ``target`` entries per KV head (None: never cut, as without a
        target or for a policy that keeps everything)."""
        if target is None:
            return None
        schedule = DecodeSchedule.make(policy, target, interval, buffer, self.geometry.num_layers, self.geometry.local)
        return None if schedule.cuts_nothing else schedule

    def decode_many(self, requests: list[DecodeRequest], max_rows: int | None = None) -> list[Decoded]:
        """Greedy decoding of every request, in batches of up to ``max_rows`` (``decoding.plan_batches``)."""
        return self.decoder.decode(requests, max_rows)

    def _sync(self) -> None:
        for device in cuda_devices([self.device, *self.layer_devices]):
            torch.cuda.synchronize(device)
