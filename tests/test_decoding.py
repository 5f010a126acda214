"""Decoding: greedy choice, ragged caches and their masks, batch planning, and batched == one at a time."""

import contextlib
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.engine import attention
from pkvbench.engine.architecture import LayerSoftmax
from pkvbench.engine.cache import RaggedCache, RaggedLayer
from pkvbench.engine.decoding import DecodeRequest, KeptEntries, greedy_rows, plan_batches
from pkvbench.policies import parse_policy


def test_barred_tokens_are_never_chosen_and_logits_stay_untouched():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]] * 3)
    barred = torch.zeros(3, 4, dtype=torch.bool)
    barred[1, 1] = barred[2, 1] = barred[2, 3] = True
    assert greedy_rows(logits, None).tolist() == [1, 1, 1]
    assert greedy_rows(logits, barred).tolist() == [1, 3, 2]
    assert logits[0].tolist() == [0.0, 5.0, 1.0, 4.0]


def ragged(lengths, dim=2, room=4, kv_heads=None):
    lengths = torch.tensor(lengths)
    batch, heads = lengths.shape
    longest = int(lengths.max())
    keys = torch.arange(batch * heads * longest * dim, dtype=torch.float32).view(batch, heads, longest, dim)
    return RaggedLayer(keys, keys.clone(), lengths, room, kv_heads or heads)


def test_new_tokens_follow_each_rows_own_entries_and_the_mask_hides_padding():
    layer = ragged([[3, 3], [1, 1]])
    new = torch.full((2, 2, 1, 2), -1.0)
    keys, _ = layer.update(new, new)
    assert keys.shape[2] == 4
    assert keys[0, 0, 3].tolist() == [-1, -1] and keys[1, 0, 1].tolist() == [-1, -1]  # right after each row's entries
    mask = layer.attention_mask()
    assert mask.shape == (2, 1, 1, 4)  # every head of a row keeps the same number: one mask row per batch row
    assert mask[0, 0, 0].tolist() == [True, True, True, True]
    assert mask[1, 0, 0].tolist() == [True, True, False, False]


def test_heads_with_different_lengths_get_their_own_mask_and_fed_tokens_are_causal():
    layer = ragged([[2, 4]])
    new = torch.zeros((1, 2, 2, 2))
    layer.update(new, new)
    mask = layer.attention_mask()
    assert mask.shape == (1, 2, 2, 6)
    assert mask[0, 0].tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False]]
    assert mask[0, 1].tolist() == [[True] * 5 + [False], [True] * 6]


def test_a_single_row_without_padding_needs_no_mask():
    layer = ragged([[5, 5]])
    new = torch.zeros((1, 2, 1, 2))
    layer.update(new, new)
    assert layer.attention_mask() is None


def test_a_cache_of_query_heads_repeats_each_new_entry_to_its_group():
    layer = ragged([[2, 2, 2, 2]], kv_heads=2)  # 4 query heads, 2 KV heads
    new = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1).expand(1, 2, 1, 2)
    keys, _ = layer.update(new, new)
    assert keys[0, :, 2, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_rows_leave_the_batch():
    layer = ragged([[3], [1], [2]])
    layer.select_rows(torch.tensor([0, 2]), [0, 2])
    assert layer.lengths.tolist() == [[3], [2]] and layer.keys.shape[0] == 2


def request(entries, heads=3, feed=(), position=1000):
    keys = [torch.zeros(heads, n, 4) for n in entries]
    return DecodeRequest(KeptEntries(keys, keys), position=position, max_new_tokens=4, feed=feed)


def test_batches_group_alike_rows_and_cap_padding_and_size():
    requests = [
        request([64, 64]),
        request([60, 70]),
        request([1000, 1000]),
        request([64, 64], feed=(1, 2)),
        request([64, 64], heads=9),
    ]
    batches = plan_batches(requests, max_rows=None)
    assert sorted(map(sorted, batches)) == [[0, 1], [2], [3], [4]]  # the full-length row would pad the small ones
    assert all(len(b) == 1 for b in plan_batches(requests, max_rows=1))


def test_a_grid_of_budgets_shares_a_batch_up_to_one_full_cache_of_padding():
    grid = [request([n, n], position=2000) for n in (64, 128, 256, 512) for _ in range(4)]
    # 64…256 padded to 256 add 7,680 entries, below one full cache (2 layers × 3 heads × 2000 = 12,000); adding a 512
    # row would add 26,112, more than the full cache and than half the 13,824 kept.
    assert [len(b) for b in plan_batches(grid, max_rows=None)] == [12, 4]
    assert [len(b) for b in plan_batches(grid, max_rows=5)] == [5, 5, 5, 1]


POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv", "h2o:scores=window", "snapkv:window=32"]
DECODE_POLICIES = ["streamingllm", "h2o", "snapkv", "tova", "rkv", "expected_attention", "random"]


@pytest.mark.model
def test_batched_decoding_gives_the_tokens_of_one_at_a_time(engine, loaded):
    """Every policy × budget on a needle prompt, with a stop string and a minimum length in play, some of them
    stored in fewer bits, and rows that cut their caches while decoding on their own schedules: decoding all
    configurations of a sample together yields exactly the tokens (and cache sizes) each gives alone."""
    from pkvbench.cell.budgets import Budget
    from pkvbench.cell.kv_formats import KVFormat
    from pkvbench.policies import parse_policy, registry
    from pkvbench.tasks.base import TaskOptions
    from pkvbench.tasks.registry import build_samples, get_task

    # every registered policy (a wrapper around SnapKV), and the head-wise and per-query-head cache layouts
    others = [
        f"{name}(snapkv)" if getattr(cls, "wraps", False) else name
        for name, cls in registry().items()
        if name not in POLICIES
    ]
    policies = [parse_policy(p) for p in [*POLICIES, *others, "adakv(snapkv):critical=true", "snapkv:gqa=query"]]
    # one prompt: each request is decoded twice (alone, then batched), the test's whole cost; a second prompt adds no path
    samples = build_samples(get_task("needle"), loaded.tokenizer, TaskOptions(lengths=(700,), depths=(100,)))
    # Rows that cut their cache while the answer is written, on schedules of their own: decode-only (every 3 tokens
    # back to 48 entries) and after a prefill budget (every 5 tokens back to 24), beside rows that never cut.
    cutting = [parse_policy(p) for p in DECODE_POLICIES]
    schedules = [("cr0", 48, 3), ("16", 24, 5)]
    differ, batched_rows = 0, 0
    for number, sample in enumerate(samples):
        prefill = engine.prefill(torch.tensor([sample.input_ids]), policies, decoding=cutting)
        requests = [
            engine.request(prefill, engine.compress(prefill, p, Budget(b)), 16, stop_strings=(".",), min_new_tokens=2)
            for p in policies
            for b in (16, 0.1)
        ]
        # caches stored in 16 bits and KIVI's integers (engine/quantized.py): uniform, head-wise and per-query-head
        requests += [
            engine.request(prefill, engine.compress(prefill, p, Budget(0.1), fmt=f), 16, stop_strings=(".",))
            for p in policies
            if p.label in ("full", "snapkv", "kvzip", "adakv(snapkv)", "snapkv:gqa=query")
            for f in (KVFormat(16), KVFormat(4, residual=8), KVFormat(2, group=16, residual=0))
        ]
        requests += [
            engine.request(
                prefill,
                engine.compress(prefill, p, Budget.parse(budget)),
                16,
                stop_strings=(".",),
                min_new_tokens=2,
                schedule=engine.schedule(p, target, interval, 4),
            )
            for p in (cutting if number == 0 else [])
            for budget, target, interval in schedules
        ]
        alone = [engine.decoder.decode_batch([r])[0] for r in requests]
        together = engine.decode_many(requests)
        batched_rows += sum(d.batch > 1 for d in together)
        differ += sum(a.tokens != b.tokens for a, b in zip(alone, together))
        assert [a.memory for a in alone] == [b.memory for b in together]  # the same cuts and cache sizes
    assert batched_rows > len(samples) * 10
    assert differ == 0


def flex_and_masked(layer, query):
    """The layer's attention for ``query`` through FlexAttention (eager) and through sdpa with its boolean mask."""
    keys, values = layer.stores
    group = query.shape[1] // keys.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        flex = attention._flex_kernel(False)(
            query, keys, values, block_mask=layer.block_mask(query.shape[1]), enable_gqa=group > 1
        )
    mask = layer.attention_mask()
    mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
    masked = torch.nn.functional.scaled_dot_product_attention(
        query, layer.keys.repeat_interleave(group, 1), layer.values.repeat_interleave(group, 1), attn_mask=mask
    )
    return flex, masked


@pytest.mark.parametrize("new", [1, 3])
def test_flex_attentions_block_mask_sees_what_the_boolean_mask_sees(new):
    """Rows and heads of different lengths across FlexAttention's blocks of 128 (whole, partly and not read), grouped
    query heads, and fed tokens causal among themselves: the same output as sdpa with the layer's mask."""
    torch.manual_seed(0)
    lengths = torch.tensor([[300, 130], [5, 256], [128, 127]])
    layer = RaggedLayer(torch.randn(3, 2, 300, 8), torch.randn(3, 2, 300, 8), lengths, room=40, kv_heads=2)
    layer.update(torch.randn(3, 2, new, 8), torch.randn(3, 2, new, 8))
    flex, masked = flex_and_masked(layer, torch.randn(3, 4, new, 8))
    torch.testing.assert_close(flex, masked, rtol=1e-5, atol=1e-6)


def tiny_engine():
    """A 2-layer random Llama in float32 on the CPU (``scripts/bench_gpu.py``'s, built from configs/gpu/tiny.json)."""
    from pkvbench.engine.generation import Engine

    script = Path(__file__).parents[1] / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", script)
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    return Engine(bench_gpu.build_model(bench_gpu.CONFIGS / "tiny.json", "cpu", torch.float32)), bench_gpu


def grid_requests(engine, cells, fmt=None):
    """A decode request per cell ``(prefill, policy, budget, options)``, its cache stored in ``fmt`` if given."""
    return [
        engine.request(prefill, engine.compress(prefill, policy, Budget(budget), fmt=fmt), 6, **options)
        for prefill, policy, budget, options in cells
    ]


@pytest.fixture(scope="module")
def tiny_cells():
    """A grid on the tiny model: uniform, per-layer (PyramidKV) and per-head (AdaKV) budgets, and the full cache;
    rows with a minimum length and a stop string; query-agnostic rows that feed a question first."""
    engine, bench_gpu = tiny_engine()
    ids = bench_gpu.random_prompt(300, engine.loaded.config.vocab_size, seed=3)
    policies = [parse_policy(p) for p in ("full", "snapkv", "pyramidkv", "adakv(snapkv)", "streamingllm")]
    prefill = engine.prefill(ids, policies)
    stopping = {"stop_strings": ("w7",), "min_new_tokens": 2}
    cells = [(prefill, p, b, stopping) for p in policies for b in (32, 150)]
    cells += [(prefill, p, 48, {"question": list(range(10, 15))}) for p in policies]
    return engine, cells


@pytest.fixture(scope="module")
def tiny_grid(tiny_cells):
    engine, cells = tiny_cells
    return engine, grid_requests(engine, cells)


HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")


class NoHostReads:
    """Any tensor read back as a Python number (a host–device sync on a GPU) fails while active, except inside
    ``kernel`` (torch's own eager FlexAttention on a CPU reads its scale; on a GPU it is a compiled kernel, which
    ``scripts/bench_gpu.py`` checks under ``torch.cuda.set_sync_debug_mode``)."""

    def __init__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        for name in HOST_READS:
            setattr(torch.Tensor, name, self.refuse(name))
        try:
            yield
        finally:
            self.restore()

    def restore(self):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)

    @staticmethod
    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"a decode step read a tensor back: Tensor.{name}")

        return read

    def kernel(self, flex):
        def unguarded(*args, **kwargs):
            refused = {name: getattr(torch.Tensor, name) for name in HOST_READS}
            self.restore()
            try:
                return flex(*args, **kwargs)
            finally:
                for name, method in refused.items():
                    setattr(torch.Tensor, name, method)

        return unguarded


def test_a_decode_step_reads_back_nothing_but_its_tokens_and_rows_get_their_tokens_alone(tiny_grid, monkeypatch):
    """Every step after the first — the choice of tokens, rows leaving the batch, the model's forward with every
    layer's update and attention — converts no tensor to a Python number (on a GPU: no sync but the tokens'), through
    masks and through FlexAttention (eager on a CPU); and in float32 each row's tokens are those it decodes alone."""
    engine, requests = tiny_grid
    guard = NoHostReads()
    monkeypatch.setattr(engine.decoder, "step_guard", guard)
    flex, flex_calls = attention._flex_kernel(False), []
    monkeypatch.setattr(attention, "_flex_kernel", lambda compiled: flex_calls.append(1) or guard.kernel(flex))
    alone = [engine.decoder.decode_batch([r])[0].tokens for r in requests]
    with attention.ragged_kernel("masked"):
        masked = engine.decode_many(requests)
    with attention.ragged_kernel("flex"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        flexed = engine.decode_many(requests)
    assert guard.entered > 40 and max(d.batch for d in masked) >= 4 and flex_calls
    assert len({tuple(t) for t in alone}) > 3  # rows differ among themselves
    assert [d.tokens for d in masked] == alone and [d.tokens for d in flexed] == alone


def test_a_decode_step_over_stored_caches_reads_back_nothing_and_rows_get_their_tokens_alone(tiny_cells, monkeypatch):
    """The same for caches stored in 16 bits and in KIVI's 8/4/2-bit integers (``engine/quantized.py``): uniform,
    per-layer and per-head budgets, packed parts of different widths and rows with none, a fed question."""
    from pkvbench.cell.kv_formats import KVFormat

    engine, cells = tiny_cells
    guard = NoHostReads()
    monkeypatch.setattr(engine.decoder, "step_guard", guard)
    formats = (KVFormat(16), KVFormat(8, group=16, residual=4), KVFormat(4, group=16), KVFormat(2, 16, residual=0))
    stored = [request for fmt in formats for request in grid_requests(engine, cells, fmt)]
    alone = [engine.decoder.decode_batch([r])[0].tokens for r in stored]
    together = engine.decode_many(stored)
    assert guard.entered > 40 and max(d.batch for d in together) >= 4
    assert len({tuple(t) for t in alone}) > 3
    assert [d.tokens for d in together] == alone


def one_step_masks(cache, new):
    """Each layer's mask after a step that writes ``new`` into every layer."""
    masks = []
    for index in range(len(cache.layers)):
        cache.update(new, new, index)
        masks.append(cache.layers[index].attention_mask())
    return masks


def test_a_step_builds_each_mask_once_for_layers_of_the_same_lengths():
    lengths = torch.tensor([[3, 3], [1, 1]])
    layers = [RaggedLayer(torch.zeros(2, 2, 3, 2), torch.zeros(2, 2, 3, 2), lengths, 4, 2) for _ in range(3)]
    cache = RaggedCache(layers, [LayerSoftmax(1.0)] * 3)
    new = torch.zeros((2, 2, 1, 2))
    masks = one_step_masks(cache, new)
    assert masks[0] is masks[1] is masks[2]
    cache.update(new, new, 0)  # the next step: lengths moved on, a new mask
    assert cache.layers[0].attention_mask() is not masks[0] and cache.layers[0].attention_mask().shape[-1] == 5


def test_stored_layers_of_the_same_counts_share_their_step_mask():
    """Caches stored in 4 bits (``engine/quantized.py``): rows of different packed counts need a mask, built once per
    step for every layer whose counts are the same."""
    from pkvbench.cell.kv_formats import KVFormat
    from pkvbench.engine.quantized import QuantizedLayer, store_layer

    torch.manual_seed(0)
    fmt = KVFormat(4, group=16, residual=4)
    rows = [
        store_layer(torch.randn(2, n, 16), torch.randn(2, n, 16), torch.tensor([n, n]), fmt, torch.bfloat16)
        for n in (40, 20)
    ]
    layers = [QuantizedLayer(rows, fmt, torch.float32, room=4, kv_heads=2) for _ in range(3)]
    cache = RaggedCache(layers, [LayerSoftmax(1.0)] * 3)
    new = torch.zeros((2, 2, 1, 16))
    masks = one_step_masks(cache, new)
    assert masks[0] is masks[1] is masks[2]
    assert masks[0][1, 0, 0, :48].tolist() == [True] * 16 + [False] * 32  # the second row packs 16 entries of 48
    cache.update(new, new, 0)
    assert cache.layers[0].attention_mask() is not masks[0]


def test_flex_attention_is_left_to_layer_kinds_that_mask_more_and_to_calls_with_extras():
    """FlexAttention's block mask encodes the lengths only: a layer kind with its own mask (a sliding window) and a
    call with arguments it does not honour (soft-capping) take the model's kernel with the layer's mask."""

    class Windowed(RaggedLayer):
        def attention_mask(self):
            return super().attention_mask()

    lengths, query = torch.tensor([[3, 3], [1, 1]]), torch.zeros(2, 4, 1, 2)
    plain, windowed = (
        kind(torch.zeros(2, 2, 3, 2), torch.zeros(2, 2, 3, 2), lengths, 4, 2) for kind in (RaggedLayer, Windowed)
    )
    with attention.ragged_kernel("flex"):
        assert attention._flex_applies("sdpa", plain, query, {"scaling": 0.5, "dropout": 0.0})
        assert not attention._flex_applies("sdpa", windowed, query, {"scaling": 0.5})
        assert not attention._flex_applies("sdpa", plain, query, {"softcap": 30.0})
        assert not attention._flex_applies("eager", plain, query, {})
    with attention.ragged_kernel("masked"):
        assert not attention._flex_applies("sdpa", plain, query, {})


def test_a_layer_kind_that_leaves_out_part_of_the_contract_fails_when_built():
    """``DecodingLayer`` is the base of every kind: one without ``held`` (or any other abstract member) cannot be
    built, and every kind the table builds is one."""
    from pkvbench.engine.cache import DecodingLayer
    from pkvbench.engine.layers import LAYER_KINDS

    class Forgetful(DecodingLayer):
        lengths = torch.zeros(1, 1)

        def lazy_initialization(self, key_states, value_states): ...
        def update(self, key_states, value_states, *args, **kwargs): ...
        def get_mask_sizes(self, query_length): ...
        def get_seq_length(self): ...
        def get_max_length(self): ...
        def attention_mask(self): ...
        def select_rows(self, rows, host_rows=None): ...

    with pytest.raises(TypeError, match="held"):
        Forgetful()
    assert all(issubclass(kind, DecodingLayer) for kind, _ in LAYER_KINDS.values())


def test_a_cut_reads_its_rows_counts_from_the_host():
    """A cut while decoding scores a row's entries per layer (``ShrinkingLayer.row_stats``): its count and its query
    ring's come from the host copies, so a cut on a GPU waits for nothing (issue 48: it read ``lengths[row, 0]`` back
    per layer, row and cut)."""
    from pkvbench.engine.architecture import LayerSoftmax
    from pkvbench.engine.shrinking import ShrinkingLayer
    from pkvbench.policies.base import Needs

    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 2, 6, 8, generator=generator)
    positions = torch.arange(6).expand(2, 2, 6).clone()
    layer = ShrinkingLayer(
        keys, keys.clone(), torch.tensor([[6, 6], [4, 4]]), 3, 2, positions,
        queries=torch.randn(2, 4, 3, 8, generator=generator), query_counts=[3, 2], start=6,
    )  # fmt: skip
    guard = NoHostReads()
    with guard():
        stats = layer.row_stats(1, 0, Needs(windows=frozenset({2}), queries=frozenset({2})), LayerSoftmax(0.5), 6, 4)
    assert stats.context_len == 4 and stats.recent_queries.shape == (4, 2, 8)
