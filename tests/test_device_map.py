"""A model placed by accelerate (``--device-map``, issue 50): layers on the CPU and offloaded to the disk, under
accelerate's hooks, give the rows of the model on one device — every policy, KIVI's stored formats and the cuts while
decoding included — and nothing reads an offloaded weight outside its forward.

On a CPU-only machine "cpu" and "disk" are the placements there are: the disk's layers keep their weights on the
``meta`` device between forwards and accelerate's hooks load them for each (``scripts/bench_gpu.py``'s check puts
layers on a GPU and the CPU). Two tiny random models of 4 layers: Llama, and gpt-oss, whose attention sinks (a
parameter of the attention module) every statistic reads and whose eager kernel reads them in its forward.
"""

from __future__ import annotations

import json

import pytest
import torch

from pkvbench.cli import main
from pkvbench.store.results import read_rows
from tests.test_architectures import CUT_WHILE_DECODING, EVERY_POLICY, ROWS, TINY, prompt, save

FAMILIES = {
    "llama": {},
    "gpt_oss": {
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 48,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "initializer_range": 0.2,
    },
}
# Half the layers (and the output layer, RoPE's module) offloaded to the disk, the others on the CPU.
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "disk",
    "lm_head": "disk",
}
OFFLOADED = (0, 2)
GRIDS = {
    # every policy (CriticalKV reads the output projection), the model's own cache and KIVI's 4 bits
    "every-policy-kv-bits": [
        "--policy",
        f"{EVERY_POLICY},adakv(snapkv):critical=true",
        "--budget",
        "32",
        "--kv-bits",
        "32,4",
        "--kv-group",
        "16",
    ],
    "decode-budget": [
        "--policy",
        CUT_WHILE_DECODING,
        "--budget",
        "48",
        "--decode-budget",
        "24",
        "--decode-interval",
        "4",
    ],
}


def tiny_model(folder, tokenizer, family: str = "llama"):
    """A tiny random model of 4 layers saved in ``folder/model`` with the embedded model's tokenizer, and
    ``DEVICE_MAP`` in ``folder/map.json``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**TINY, "num_hidden_layers": 4, **FAMILIES[family]})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "map.json").write_text(json.dumps(DEVICE_MAP))
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    return request.param, tiny_model(tmp_path_factory.mktemp(request.param), tokenizer, request.param)


def outcome(folder) -> list[dict]:
    """Every row's fields but the seconds it took."""
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in read_rows(folder)]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_a_run_on_the_cpu_and_the_disk_writes_the_rows_of_the_run_on_one_device(family, grid, tmp_path, capsys):
    _, folder = family
    args = ["run", "--model", str(folder / "model"), "--task", "needle", "--lengths", "100", "--depths", "50"]
    args += ["--max-new-tokens", "4", "--quiet", *GRIDS[grid]]
    for run, extra in (("plain", []), ("placed", ["--device-map", str(folder / "map.json")])):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--out", str(tmp_path / run), *extra])
        assert exit_info.value.code == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "meta device" not in err  # accelerate's note is library chatter: kept off the terminal
    plain, placed = outcome(tmp_path / "plain"), outcome(tmp_path / "placed")
    assert len(plain) == len(placed) > 0
    for ours, theirs in zip(placed, plain):
        assert ours == theirs, ours["policy"]
    model = json.loads((tmp_path / "placed" / "run.json").read_text())["model"]
    assert (
        model["device_map"] == DEVICE_MAP
        and "device_map" not in json.loads((tmp_path / "plain" / "run.json").read_text())["model"]
    )


def test_offloaded_weights_wait_on_the_meta_device_and_load_for_each_forward(family, tmp_path):
    """The disk's layers hold no weight between forwards: accelerate's hooks load them for each forward (counted)
    and drop them after; the sinks the statistics read were loaded for the read, onto the layer's device; reading
    the model's layers (the probe) leaves every hook accelerate installed in place."""
    from accelerate.utils import has_offloaded_params

    from pkvbench.cell.budgets import Budget
    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model
    from pkvbench.policies.spec import parse_policy
    from tests.helpers import decode_one

    name, folder = family
    placement = {"device_map": str(folder / "map.json"), "offload_folder": str(tmp_path / "offload")}
    loaded = load_model(str(folder / "model"), device="cpu", dtype="float32", **placement)
    hooked = {module: module.forward for module in loaded.model.modules() if hasattr(module, "_hf_hook")}
    placed = Engine(loaded)  # reads each layer's behaviour through a forward of its own (engine/probe.py)
    assert hooked and all(module.__dict__.get("forward") is forward for module, forward in hooked.items())
    plain = Engine(load_model(str(folder / "model"), device="cpu", dtype="float32"))
    layers = placed.model.model.layers
    projections = [layers[i].self_attn.q_proj for i in OFFLOADED]
    loads = []

    def counted(load):
        def pre_forward(module, *args, **kwargs):
            loads.append(module)
            return load(module, *args, **kwargs)

        return pre_forward

    for module in projections:  # count the hooks' loads of the weights
        module._hf_hook.pre_forward = counted(module._hf_hook.pre_forward)

    def offloaded_weights():
        return [p.device.type for i in OFFLOADED for p in layers[i].parameters()]

    assert all(has_offloaded_params(module) for module in projections)
    assert set(offloaded_weights()) == {"meta"} and placed.loaded.placement == DEVICE_MAP
    assert {p.device.type for p in layers[1].parameters()} == {"cpu"}
    if name == "gpt_oss":
        assert all(s.sinks is not None and s.sinks.device.type == "cpu" for s in placed.softmaxes)

    ids = torch.randint(0, TINY["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(1))
    tokens = []
    for engine in (plain, placed):
        policy = parse_policy("snapkv")
        prefill = engine.prefill(ids, [policy])
        tokens.append(decode_one(engine, prefill, engine.compress(prefill, policy, Budget(16)), 8).tokens)
    assert tokens[0] == tokens[1]
    assert len(loads) == len(projections) * (1 + 7)  # the prefill and each step after the first token loaded them
    assert set(offloaded_weights()) == {"meta"}  # ... and dropped them after


def test_funnel_and_lm_eval_take_the_placement(family, tmp_path, capsys):
    """``pkvbench funnel`` measures the same attention placed as on one device; lm-eval's model args place the model
    as ``run``'s options do."""
    from pkvbench.lm_eval.grid import Grid, GridSpec

    name, folder = family
    if name != "llama":
        pytest.skip("one family is enough for the entry points")
    args = ["funnel", "--model", str(folder / "model"), "--task", "needle", "--lengths", "100", "--depths", "50"]
    for run, extra in (("plain", []), ("placed", ["--device-map", str(folder / "map.json")])):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--quiet", "--out", str(tmp_path / run), *extra])
        assert exit_info.value.code == 0, capsys.readouterr().err
    assert (tmp_path / "plain" / "funnel.csv").read_text() == (tmp_path / "placed" / "funnel.csv").read_text()

    spec = GridSpec.parse({"model": str(folder / "model"), "device": "cpu", "device_map": str(folder / "map.json")})
    assert Grid(spec).engine.loaded.placement == DEVICE_MAP


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-memory", "cpu=1GiB"], "--max-memory only shapes --device-map; give it"),
        (["--offload-folder", "off"], "--offload-folder only shapes --device-map; give it"),
        (["--device-map", "everywhere"], "--device-map everywhere: neither one of auto, balanced"),
        (["--device-map", "auto", "--max-memory", "cpu=lots"], "size lots of cpu"),
        (["--device-map", "auto", "--max-memory", "gpu0=1GiB"], "device gpu0 is not one of a GPU index"),
        (["--device-map", "MAP", "--max-memory", "0=1GiB"], "--max-memory sizes the devices a strategy"),
        (["--device-map", "BAD"], "module 'lm_head': device tpu is not one of a GPU index"),
    ],
)
def test_placement_options_are_checked_before_anything_loads(args, message, tmp_path, capsys):
    (tmp_path / "map.json").write_text(json.dumps(DEVICE_MAP))
    (tmp_path / "bad.json").write_text(json.dumps({**DEVICE_MAP, "lm_head": "tpu"}))
    args = [{"MAP": str(tmp_path / "map.json"), "BAD": str(tmp_path / "bad.json")}.get(a, a) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_max_memory_takes_accelerates_sizes_in_every_spelling():
    from pkvbench.cell.models import max_memory_value

    expected = {0: "20GiB", 1: "20GiB", "cpu": "60GB", "disk": 100}
    assert max_memory_value(("0=20GiB,1=20GiB", "cpu=60GB", "disk=100"), "--max-memory") == expected
    assert max_memory_value("cuda:0:20GiB+1:20GiB+cpu:60GB+disk:100", "max_memory") == expected  # lm-eval's
    assert max_memory_value({0: "20GiB", 1: "20GiB", "cpu": "60GB", "disk": 100}, "max_memory") == expected
    assert max_memory_value((), "--max-memory") == {}


def test_a_map_that_names_a_gpu_is_one_line_where_there_is_none(tmp_path, capsys):
    from pkvbench.cell.models import Placement
    from pkvbench.engine.placement import dispatch_arguments
    from pkvbench.errors import PkvError

    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA has GPU 0")
    with pytest.raises(PkvError, match="--device-map places modules on 0, but no CUDA device is available"):
        dispatch_arguments(Placement({**DEVICE_MAP, "lm_head": 0}), "cpu")


def test_a_map_that_splits_tied_weights_is_one_line_before_the_weights_load(tmp_path):
    """SmolLM2 ties its output layer to its embedding: the map that puts lm_head on the disk and the embedding on
    the CPU is refused before loading (accelerate would fail at the first forward)."""
    from transformers import AutoConfig

    from pkvbench.engine.models import load_model, model_path
    from pkvbench.engine.placement import check_tied_weights
    from pkvbench.errors import PkvError

    assert AutoConfig.from_pretrained(model_path("smollm2-135m")[0]).tie_word_embeddings
    (tmp_path / "map.json").write_text(json.dumps(DEVICE_MAP))
    with pytest.raises(PkvError, match="places lm_head on disk and model.embed_tokens on cpu, but this model's output"):
        load_model("smollm2-135m", device="cpu", device_map=str(tmp_path / "map.json"))
    check_tied_weights({**DEVICE_MAP, "lm_head": "cpu"}, AutoConfig.for_model("llama", tie_word_embeddings=True))
    check_tied_weights(DEVICE_MAP, AutoConfig.for_model("llama", tie_word_embeddings=False))


def split_over_cpu_and_disk(folder) -> dict[str, str]:
    """A device map of the model saved in ``folder``: its even layers (and every module beside the layers but the
    embedding, and the output layer where the embedding's weight is tied to it) offloaded to the disk, the rest on
    the CPU; read from the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    device_map = {"lm_head": "cpu" if config.tie_word_embeddings else "disk"}
    for name, _ in model.model.named_children():
        if name == "layers":
            device_map |= {f"model.layers.{i}": "disk" if i % 2 == 0 else "cpu" for i in range(len(model.model.layers))}
        else:
            device_map[f"model.{name}"] = "cpu" if name == "embed_tokens" else "disk"
    return device_map


# The families whose attention the Llama and gpt-oss runs above do not cover: partial RoPE, a mixed local/global
# model, soft-capped logits, per-layer RoPE, interleaved RoPE (the three last tie the output layer to the embedding).
PLACED_ROWS = [row for row in ROWS if row.name in ("phi3", "qwen2-mixed", "gemma2", "gemma3_text", "cohere")]


@pytest.mark.parametrize("row", PLACED_ROWS, ids=lambda row: row.name)
def test_a_family_placed_on_the_cpu_and_the_disk_decodes_as_on_one_device(row, tmp_path, tokenizer):
    """A family's tiny model (tests/test_architectures.py's row), half its layers offloaded to the disk: a batch of
    caches — StreamingLLM's, SnapKV's, H2O's cut while the answer is written — keeps the entries and writes the
    tokens of the model on one device."""
    from pkvbench.cell.budgets import Budget
    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model
    from pkvbench.policies.spec import parse_policy

    folder = tmp_path / "model"
    save(row, folder, tokenizer)
    placement = {"device_map": split_over_cpu_and_disk(folder), "offload_folder": str(tmp_path / "offload")}
    outcomes = []
    for where in ({}, placement):
        engine = Engine(load_model(str(folder), device="cpu", dtype="float32", **where))
        policies = [parse_policy(name) for name in ("streamingllm", "snapkv", "h2o")]
        prefill = engine.prefill(prompt(row), policies, decoding=policies[2:])
        caches = [engine.compress(prefill, policy, Budget(row.budget)) for policy in policies[:2]]
        caches.append(engine.compress(prefill, policies[2], Budget(2 * row.budget)))
        schedules = [None, None, engine.schedule(policies[2], row.budget, 4, 4)]
        requests = [
            engine.request(prefill, cache, row.new_tokens, schedule=schedule)
            for cache, schedule in zip(caches, schedules)
        ]
        kept = [[[heads.tolist() for heads in layer] for layer in cache.kept_positions()] for cache in caches]
        outcomes.append(([decoded.tokens for decoded in engine.decode_many(requests)], kept))
    assert engine.loaded.placement is not None and "disk" in engine.loaded.placement.values()
    assert outcomes[1] == outcomes[0]
