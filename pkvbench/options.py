"""The options of ``pkvbench run``, ``funnel`` and ``budgets``, each declared once: a field of ``RunConfig`` /
``FunnelConfig`` (``SampleConfig``: what both share) / ``BudgetsConfig`` whose metadata (``config.option``) says its
flag, kind, default, choices, help and check. The command line's flags (``cli.config_options``), a config file's keys
(``config.read_run_config``) and the Python API's checks (``api.checked``) derive from it; its ``roles`` say where else
the field goes, so that no table lists the fields again: what ``run.json`` records (``api.recorded``), how samples are
chosen (``TaskOptions``), how every sample runs (``RunSettings``, below), how the model loads (``model_settings``) and
which options lm-eval's backend takes as model args (``lm_eval.grid.MODEL_ARGS``, ``pkvbench lm-eval``'s options).

Light on purpose (no torch, no pandas): the command line builds its options from it at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pkvbench.cell import kv_formats
from pkvbench.cell.budgets import DEFAULT_BUDGET, DEFAULT_DECODING_BUDGET
from pkvbench.cell.models import (
    ALIASES,
    DEFAULT_MODEL,
    DEVICE_MAP_STRATEGIES,
    DEVICES,
    DTYPES,
    device_map_value,
    max_memory_value,
)
from pkvbench.cell.schema import (
    DEFAULT_PROTOCOL,
    DEFAULT_QUERY_MODE,
    MULTI_TURN,
    PROTOCOLS,
    QUERY_MODES,
    TURN_ANSWERS,
    TURN_COMPRESSIONS,
)
from pkvbench.config import (
    FLAG,
    LIST,
    MAX_LAYERS,
    MODEL,
    MODEL_ARG,
    PAIR,
    RECORDED,
    REPEATED,
    SEED_MAX,
    SETTING,
    TASK,
    list_value,
    name_value,
    names,
    number,
    numbers,
    one_each_of,
    option,
    options_of,
    options_with,
    pair_values,
    parse_bool,
    path_list,
    path_value,
    read_run_config,
    whole,
)

EXECUTORS = ("local", "ray")


@dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """What ``pkvbench run`` and ``pkvbench funnel`` share: the model and how it runs, which samples, where the
    results go. List-valued fields take a list or a comma string (``tasks="needle,trec"``). ``roles`` says where a
    field goes besides its option (``config.RECORDED`` …)."""

    # which samples
    tasks: Sequence[str] | str = option(
        ("needle",),
        flag="--task",
        kind=LIST,
        check=list_value,
        roles=(RECORDED,),
        help="Task name(s), comma-separated (see `pkvbench list`).",
    )
    lengths: Sequence[int] | str | None = option(
        None,
        kind=LIST,
        check=numbers(int),
        roles=(RECORDED, TASK),
        help="Context lengths in prompt tokens, comma-separated (needle, RULER default: 1000,2000,4000).",
    )
    depths: Sequence[float] | str | None = option(
        None,
        kind=LIST,
        check=numbers(float),
        roles=(RECORDED, TASK),
        help="Needle depths in percent, comma-separated (default: 0,25,50,75,100).",
    )
    turns: int | None = option(
        None,
        check=whole(1),
        roles=(RECORDED, TASK),  # recorded only where given (``api.ResolvedRun.recorded_options``)
        help="Questions asked in turn about each context, for conversation tasks (scbench_*: default the task's; "
        "SCBench's files: the first N turns, default all).",
    )
    limit: int | None = option(
        None,
        check=whole(1),
        roles=(RECORDED, TASK),
        help="At most this many samples per task (RULER, trec-fewshot: per task and length).",
    )
    seed: int = option(0, check=whole(0, SEED_MAX), roles=(RECORDED, TASK), help="Seed for generated tasks and torch.")
    data_dir: str | None = option(
        None,
        check=path_value,
        roles=(RECORDED, TASK),
        help="Folder with a task's data files (e.g. LongBench <name>.jsonl).",
    )
    verify: bool = option(
        True,
        flag="--no-verify",
        kind=FLAG,
        check=parse_bool,
        roles=(TASK,),
        help="Do not check data files against their known checksums.",
    )
    max_length: int | None = option(
        None,
        check=whole(1),
        roles=(RECORDED, TASK),
        help="Truncate longer prompts to this many tokens (tasks that do).",
    )
    sample_ids: Sequence[str] | str | None = option(
        None,
        flag="--sample-id",
        kind=LIST,
        check=names,
        roles=(RECORDED, TASK),
        help="Only these sample ids, comma-separated.",
    )
    include_paths: Sequence[str] = option(
        (),
        flag="--include-path",
        kind=REPEATED,
        check=path_list,
        help="A folder of your own task YAML files (repeatable; $PKVBENCH_TASKS works too).",
    )
    # the model, and how it runs
    model: str = option(
        DEFAULT_MODEL,
        check=name_value,
        roles=(RECORDED, MODEL, MODEL_ARG),
        help=f"Alias ({', '.join(ALIASES)}), Hugging Face model id, local folder, or a .gguf file.",
    )
    device: str = option("auto", choices=DEVICES, roles=(RECORDED, MODEL, MODEL_ARG))
    dtype: str = option(
        "auto", choices=DTYPES, roles=(RECORDED, MODEL, MODEL_ARG), help="auto = float32 on CPU, bfloat16 on CUDA."
    )
    attn_implementation: str = option(
        "sdpa",
        check=name_value,
        roles=(RECORDED, MODEL, MODEL_ARG),
        help="transformers attention kernel (sdpa, eager, flash_attention_2, ...).",
    )
    device_map: str | Path | Mapping[str, Any] | None = option(
        None,
        check=device_map_value,
        roles=(MODEL, MODEL_ARG),
        help=f"Place the model over several devices with accelerate: {', '.join(DEVICE_MAP_STRATEGIES)} (from each "
        "device's free memory), or a JSON/YAML file mapping module names to devices (0, cuda:1, cpu, disk). Each "
        "layer's cache lives where the layer runs; the tokens are those of one device (docs/big-models.md).",
    )
    max_memory: Mapping[int | str, int | str] | Sequence[str] = option(
        (),
        kind=PAIR,
        check=max_memory_value,
        roles=(MODEL, MODEL_ARG),
        help="With --device-map auto (or another strategy): the memory a device may take, DEVICE=SIZE (0=20GiB, "
        "cpu=60GiB; repeatable or comma-separated), as accelerate's max_memory.",
    )
    offload_folder: str | Path | None = option(
        None,
        check=path_value,
        roles=(MODEL, MODEL_ARG),
        help="With --device-map: where weights placed on the disk go (default: a temporary folder).",
    )
    # where the results go
    out: str | Path | None = option(
        None,
        check=path_value,
        help="Result folder (default: results/runs/<model>/<tasks>, for funnel results/funnel/<model>/<tasks>).",
    )
    overwrite: bool = option(
        False,
        kind=FLAG,
        check=parse_bool,
        help="Start afresh in --out: its pkvbench files go once the model has loaded (a pkvbench folder only; other "
        "files stay).",
    )
    quiet: bool = option(
        False,
        kind=FLAG,
        check=parse_bool,
        help="No progress bar (and for funnel no verdict on the terminal; it is still written).",
    )


@dataclass(frozen=True, kw_only=True)
class RunConfig(SampleConfig):
    """Everything a run is: the model, tasks and samples (``SampleConfig``'s fields), policies × budgets, where it
    runs. Each field's help is its ``pkvbench run`` option's.

    ``policies=None`` is the default grid (the full cache and the paper's four policies). Values are checked by
    ``evaluate`` (``PkvError`` says what is wrong), exactly as the command line checks them.
    """

    policies: Sequence[str] | str | None = option(
        None,
        flag="--policy",
        kind=LIST,
        check=list_value,
        roles=(RECORDED, MODEL_ARG),
        show_default="full and the paper's four",
        help="Policies, comma-separated; options inline as name:opt=value, e.g. snapkv:window=32.",
    )
    budgets: Sequence[str | int | float] | str | None = option(
        None,
        flag="--budget",
        kind=LIST,
        check=list_value,
        roles=(RECORDED, MODEL_ARG),
        show_default=f"{DEFAULT_BUDGET}; with --decode-budget {DEFAULT_DECODING_BUDGET}, nothing cut at the prefill; "
        "none with --memory",
        help="Budgets, comma-separated: below 1 a fraction of the prompt (0.007 = 0.7%), else entries per KV head per "
        "layer (cr0: the whole prompt).",
    )
    memory: Sequence[str | float] | str | None = option(
        None,
        kind=LIST,
        check=list_value,
        roles=(MODEL_ARG,),  # recorded as budgets: a memory budget is one of them (``mem0.05``)
        help="Memory budgets instead of --budget, comma-separated: a fraction of the full cache's bytes at 16 bits per "
        "value (0.05) or a size (2MiB); each policy keeps as many entries as fit, in each --kv-bits format "
        "(docs/memory.md).",
    )
    kv_bits: Sequence[int] | str | None = option(
        None,
        kind=LIST,
        check=list_value,
        roles=(RECORDED, MODEL_ARG),
        help="How each kept value is stored, comma-separated: 16 bits, KIVI's 8, 4, 2 (keys per channel, values per "
        f"token), or {', '.join(kv_formats.NAMED)} (FP8 as vLLM stores it; TurboQuant), options inline as "
        "fp8:scale=prompt, tq3:qjl=true (docs/memory.md) [default: the model's own cache, in its dtype: 32 on a CPU].",
    )
    kv_group: int | None = option(
        None,
        check=whole(1),
        implied=kv_formats.DEFAULT_GROUP,
        roles=(RECORDED, SETTING, MODEL_ARG),
        help="With --kv-bits 8, 4 or 2: KIVI's group size G, tokens per key group, channels per value group (must "
        "divide the head size).",
    )
    kv_residual: int | None = option(
        None,
        check=whole(0),
        implied=kv_formats.DEFAULT_RESIDUAL,
        roles=(RECORDED, SETTING, MODEL_ARG),
        help="With --kv-bits 8, 4 or 2: KIVI's residual R, each head's last R kept entries stay in 16 bits, as do the "
        "answer's.",
    )
    policy_args: Mapping[str, Any] | Sequence[str] = option(
        (),
        flag="--policy-arg",
        kind=PAIR,
        check=pair_values,
        roles=(MODEL_ARG,),  # recorded in the policies' labels
        help="Option for every policy that has it (window, sink, kernel, pooling, beta, gqa, scores, normalize). "
        "Repeatable.",
    )
    protocol: str = option(
        DEFAULT_PROTOCOL,
        choices=PROTOCOLS,
        roles=(RECORDED, SETTING, MODEL_ARG),
        help="exact: every policy keeps exactly L·k entries per KV head; reference: select as the PyramidKV paper's "
        "code did (one set per query head, its PyramidKV budgets, topk ties; docs/protocol.md); kvpress: each policy "
        "with the settings of kvpress's press (docs/kvpress-crosscheck.md).",
    )
    query_modes: Sequence[str] | str = option(
        (DEFAULT_QUERY_MODE,),
        flag="--query-mode",
        kind=LIST,
        check=one_each_of(QUERY_MODES),
        roles=(RECORDED, MODEL_ARG),
        help="Where the question is: aware (inside the compressed prompt, the paper's protocol), agnostic (added after "
        "the context is compressed; one compressed context answers every question), multi-turn (the questions asked in "
        "turn, one conversation carried on one compressed cache: SCBench's protocol), or several, comma-separated.",
    )
    turn_compressions: Sequence[str] | str | None = option(
        None,
        flag="--turn-compression",
        kind=LIST,
        check=one_each_of(TURN_COMPRESSIONS),
        roles=(RECORDED,),
        implied=(TURN_COMPRESSIONS[0],),
        show_default=f"{TURN_COMPRESSIONS[0]}, with --query-mode {MULTI_TURN}",
        help=f"With --query-mode {MULTI_TURN}: compress the cache once, after the context, or again after every turn, "
        f"back to its budget ({', '.join(TURN_COMPRESSIONS)}; comma-separated, an axis of the grid).",
    )
    turn_answers: str | None = option(
        None,
        choices=TURN_ANSWERS,
        roles=(RECORDED, SETTING),
        implied=TURN_ANSWERS[0],
        show_default=f"{TURN_ANSWERS[0]}, with --query-mode {MULTI_TURN}",
        help=f"With --query-mode {MULTI_TURN}: what the conversation holds as each earlier answer, the model's own "
        "(model) or the reference answer (reference: teacher-forced turns, SCBench's default).",
    )
    task_args: Mapping[str, Any] | Sequence[str] = option(
        (),
        flag="--task-arg",
        kind=PAIR,
        check=pair_values,
        help="Task setting for every task (chat_template=false, min_new_tokens=1, stop_strings=[]). Repeatable.",
    )
    max_new_tokens: int | None = option(
        None, check=whole(1), roles=(RECORDED, SETTING), help="Override the task's answer length."
    )
    decode_batch: int | None = option(
        None,
        check=whole(1),
        roles=(SETTING, MODEL_ARG),
        help="At most this many configurations of a sample decode together (default: no cap; a batch pads its caches "
        "by at most one full cache of the prompt, or half what they keep if more); 1 decodes one configuration at a "
        "time.",
    )
    decode_budgets: Sequence[str | int] | str | None = option(
        None,
        flag="--decode-budget",
        kind=LIST,
        check=list_value,
        roles=(RECORDED, MODEL_ARG),
        help="Also cut the cache while the answer is written, back to this many entries per KV head per layer "
        "(comma-separated, an axis of the grid; none = never; docs/decoding.md).",
    )
    decode_interval: int | None = option(
        None,
        check=whole(1),
        implied=16,
        roles=(RECORDED, SETTING, MODEL_ARG),
        help="With --decode-budget: cut every this many new tokens.",
    )
    decode_buffer: int | None = option(
        None,
        check=whole(0),
        implied=8,
        roles=(RECORDED, SETTING, MODEL_ARG),
        help="With --decode-budget: the newest entries a cut always keeps.",
    )
    shard: str | None = option(
        None,
        check=name_value,
        roles=(RECORDED,),
        help="Run only shard i of n (i/n, 1-based): every n-th sample, each with its whole grid. Give each shard its "
        "own --out and combine them with `pkvbench merge`.",
    )
    # where the samples run
    executor: str = option(
        "local",
        choices=EXECUTORS,
        help="Where the samples run: this process, or Ray workers that each load the model once "
        "(pip install 'pkvbench[ray]'). Results and resume are the same.",
    )
    ray_address: str | None = option(
        None,
        check=name_value,
        help="With --executor ray: 'auto' or HOST:PORT of an existing Ray cluster (default: start one on this machine, "
        "loopback only).",
    )
    workers: int | None = option(
        None,
        check=whole(1),
        help="With --executor ray: how many workers (default: as many as the cluster's CPUs and GPUs fit).",
    )
    gpus_per_worker: float | None = option(
        None,
        check=number(minimum=0),
        help="With --executor ray: GPUs each worker reserves (default: 1 if the cluster has GPUs, else 0; 0.5 puts two "
        "workers on a GPU; 2 or more: each worker's model placed over its GPUs, --device-map auto unless given).",
    )

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> RunConfig:
        """A YAML run config (keys as ``pkvbench run``'s long options); ``overrides`` win over the file."""
        return cls(**{**read_run_config(path, options_of(cls)), **overrides})


@dataclass(frozen=True, kw_only=True)
class FunnelConfig(SampleConfig):
    """``pkvbench funnel``: how concentrated each layer's and head's attention is (PyramidKV's premise)."""

    window: int = option(
        8,
        check=whole(1),
        roles=(RECORDED,),
        help="Observation window: the last queries whose attention is measured (SnapKV/PyramidKV's window).",
    )
    sink: int = option(4, check=whole(0), roles=(RECORDED,), help="First tokens counted as the attention sink.")
    top_k: int = option(128, check=whole(1), roles=(RECORDED,), help="k of the top-k mass statistic.")
    budget: str | int | float = option(
        int(DEFAULT_BUDGET),
        check=list_value,
        help="Budget whose PyramidKV per-layer allocation is drawn over the curves (fraction or entries).",
    )


@dataclass(frozen=True, kw_only=True)
class BudgetsConfig:
    """``pkvbench budgets``: the per-layer budgets of policies × budgets on a model of ``layers`` layers and a prompt
    of ``context`` tokens (``api.layer_budget_table``'s arguments; the default is the embedded model's shape)."""

    policies: str = option(
        "pyramidkv",
        flag="--policy",
        kind=LIST,
        check=list_value,
        help="Policies, comma-separated (options as in `run`).",
    )
    budgets: str = option(
        DEFAULT_BUDGET,
        flag="--budget",
        kind=LIST,
        check=list_value,
        help="Budgets, comma-separated (fractions or entry counts).",
    )
    policy_args: Sequence[str] = option(
        (), flag="--policy-arg", kind=PAIR, check=pair_values, help="Option for every policy that has it."
    )
    layers: int = option(
        30,
        check=whole(1, MAX_LAYERS),
        help="Number of layers that keep per-token entries (a hybrid model's attention layers; the default: the embedded model's).",
    )
    context: int = option(8192, check=whole(1), help="Prompt length T in tokens.")
    protocol: str = option(
        DEFAULT_PROTOCOL,
        choices=PROTOCOLS[:2],  # exact, reference
        help="reference: the budgets the PyramidKV paper's code computes (docs/protocol.md).",
    )


def model_settings(config: Any) -> dict[str, Any]:
    """How the model loads, as ``config`` (a ``RunConfig``, ``FunnelConfig`` or anything with the fields) says:
    ``load_model``'s keywords, the fields marked ``MODEL``."""
    return {declared.name: getattr(config, declared.name) for declared in options_with(SampleConfig, MODEL)}


def _settings_class() -> type:
    """``RunSettings``: a frozen dataclass of the ``RunConfig`` fields marked ``SETTING``, each defaulting to the
    value a run gives it (an option that shapes another: its ``implied`` value)."""
    settings = [
        (o.name, Any, dataclasses.field(default=o.implied if o.implied is not None else o.default))
        for o in options_with(RunConfig, SETTING)
    ]
    cls = dataclasses.make_dataclass("RunSettings", settings, frozen=True, kw_only=True)
    cls.__module__ = __name__  # where pickle (Ray's workers) finds it
    cls.__doc__ = (
        "How every sample of a run is run, whichever executor runs it: the RunConfig fields marked SETTING (the "
        "answer's length, the decode batch, the protocol recorded in every row, KIVI's group and residual, the "
        "schedule of cuts while decoding), as the run filled them in."
    )
    return cls


RunSettings = _settings_class()
