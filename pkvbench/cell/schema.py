"""The result row's vocabulary: every field pkvbench writes in a line of ``samples.jsonl``, in the order it writes
them, each in one group, and the query modes.

- **identity**: what tells one row from another: the store's key (``results.row_key``: task, sample, policy, budget,
  query mode, decode budget and, for a cache not stored as the model's own, its storage) and, across run folders,
  the model (``report.load_runs``);
- **configuration**: the settings a row was run under, recorded so that a resume or a merge can refuse another;
- **measure**: what the run produced: the prediction and what scores it, sizes, bytes, timings;
- **sample**: the sample's size as compressed, shown with the sample's own fields (``length``, ``depth``, ...: a
  task's extra columns, written after the schema's);
- **text**: what a person reads beside the prediction (the question, the context's first and last tokens).

Everything else derives from ``ROW``: the runner writes a row through ``arrange`` (a field not declared here is
refused), and the store's checks, the reports, the HTML page and the exports read the names below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AWARE = "aware"  # the question is inside the compressed prompt (the paper's protocol)
AGNOSTIC = "agnostic"  # the question is added after the context is compressed
MULTI_TURN = "multi-turn"  # the questions are asked in turn, one conversation on one cache (SCBench's protocol)
QUERY_MODES = (AWARE, AGNOSTIC, MULTI_TURN)  # in the order tables list them
DEFAULT_QUERY_MODE = AWARE  # also what rows written before the query mode was recorded were
# A conversation's cache is compressed once after the context (a session's cache), or cut back to its budget after
# every turn as well (a server reclaiming memory); its earlier answers are the model's own, or the reference answers
# (teacher-forced turns).
ONCE, EVERY_TURN = "once", "every-turn"
TURN_COMPRESSIONS = (ONCE, EVERY_TURN)
MODEL_ANSWERS, REFERENCE_ANSWERS = "model", "reference"
TURN_ANSWERS = (MODEL_ANSWERS, REFERENCE_ANSWERS)
NO_TURNS = "none"  # a row's turn compression where it is not a turn of a conversation (tables, the gate's cells)
# How the policies select (a row's ``protocol``): pkvbench's exact budgets, the PyramidKV paper's code, kvpress's presses.
PROTOCOLS = ("exact", "reference", "kvpress")
DEFAULT_PROTOCOL = PROTOCOLS[0]  # exact
FORMATS = ("markdown", "csv", "latex")  # what a table is written as (report.render), the first by default

IDENTITY, CONFIGURATION, MEASURE, SAMPLE, TEXT = "identity", "configuration", "measure", "sample", "text"
GROUPS = (IDENTITY, CONFIGURATION, MEASURE, SAMPLE, TEXT)


@dataclass(frozen=True)
class Field:
    name: str
    group: str
    meaning: str
    required: bool = False  # in every row of every version (and in hand-made ones): a file without it is not results
    only_with: str | None = None  # written only where this field is set (not None)


ROW: tuple[Field, ...] = (
    Field("task", IDENTITY, "the task's name", required=True),
    Field("sample_id", IDENTITY, "the sample's id, ``<sample>/<question>`` when it asks several", required=True),
    Field("policy", IDENTITY, "the policy: its name and the options that differ from their defaults", required=True),
    Field(
        "budget", IDENTITY, "the budget as given: tokens, a fraction kept, ``cr<ratio>``, ``mem<bytes>``", required=True
    ),
    Field("query_mode", IDENTITY, "where the question was: one of QUERY_MODES"),
    Field("decode_budget", IDENTITY, "the entries per KV head the cache was cut back to while decoding, or None"),
    Field(
        "turn_compression",
        IDENTITY,
        "a conversation's: compressed once, or every turn (TURN_COMPRESSIONS)",
        only_with="turn_compression",
    ),
    Field("model", IDENTITY, "the model's alias, Hugging Face id or GGUF path"),
    Field("task_version", CONFIGURATION, "the task file's version"),
    Field("task_hash", CONFIGURATION, "hash of the task's prompt-shaping keys"),
    Field("protocol", CONFIGURATION, "the protocol the policies were parsed under"),
    Field("policy_options", CONFIGURATION, "every option of the policy"),
    Field("budget_tokens", MEASURE, "entries kept, mean over layers"),
    Field("requested_tokens", CONFIGURATION, "the entries the budget asked for"),
    Field("context_tokens", SAMPLE, "the tokens compressed: the whole prompt, or the context"),
    Field("question_tokens", MEASURE, "the tokens after the context (a conversation's turn: this turn's, fed)"),
    Field("turn", SAMPLE, "a conversation's turn, from 1", only_with="turn_compression"),
    Field(
        "turn_answers", CONFIGURATION, "what earlier turns' answers were: TURN_ANSWERS", only_with="turn_compression"
    ),
    Field(
        "conversation_tokens",
        SAMPLE,
        "tokens of the conversation before this turn's answer",
        only_with="turn_compression",
    ),
    Field("kv_kept", MEASURE, "entries kept per layer"),
    Field("kv_bytes", MEASURE, "bytes of the compressed cache as stored"),
    Field("kv_entries", MEASURE, "entries kept, summed over layers and heads"),
    Field("kept_fingerprint", MEASURE, "which entries each head kept (pkvbench/cell/fingerprints.py)"),
    Field("kv_native", IDENTITY, "whether the cache was the model's own, in its dtype"),
    Field("kv_bits", IDENTITY, "bits per stored value"),
    Field("kv_group", IDENTITY, "KIVI's quantization group"),
    Field("kv_residual", IDENTITY, "KIVI's entries kept in 16 bits"),
    Field("kv_format", IDENTITY, "a named storage format with its options: fp8, fp8_e5m2, tq4, tq3:qjl=true"),
    Field("memory_target", CONFIGURATION, "the bytes a memory budget allowed, or None"),
    Field("memory_fraction", MEASURE, "kv_bytes over the full cache's at 16 bits per value"),
    Field("attention_weights", CONFIGURATION, "what attention the policy needed recorded"),
    Field("pred", MEASURE, "the prediction"),
    Field("answers", MEASURE, "the reference answers it was scored against"),
    Field("score", MEASURE, "the task metric's score, from 0 to 1", required=True),
    Field("new_tokens", MEASURE, "tokens generated"),
    Field("hit_limit", MEASURE, "whether generation stopped at the token limit"),
    Field("peak_kv_entries", MEASURE, "the largest cache while decoding, in entries"),
    Field("peak_kv_bytes", MEASURE, "the largest cache while decoding, in bytes"),
    Field("decode_interval", CONFIGURATION, "new tokens between cuts", only_with="decode_budget"),
    Field("decode_buffer", CONFIGURATION, "newest entries every cut keeps", only_with="decode_budget"),
    Field("decode_cuts", MEASURE, "cuts made while decoding", only_with="decode_budget"),
    Field("kv_trace", MEASURE, "[tokens so far, entries] around each cut", only_with="decode_budget"),
    Field("prefill_s", MEASURE, "seconds of the shared prefill"),
    Field("extra_pass_s", MEASURE, "seconds of a policy's extra pass (KVzip's reconstruction)"),
    Field("selection_s", MEASURE, "seconds choosing the entries"),
    Field("decode_s", MEASURE, "seconds decoding"),
    Field("decode_batch", MEASURE, "rows decoded together"),
    Field("question_text", TEXT, "the question's text"),
    Field("context_head", TEXT, "the context's first tokens (all of a short context)"),
    Field("context_tail", TEXT, "the context's last tokens (empty for a short context)"),
)

FIELDS = tuple(field.name for field in ROW)
_DECLARED = frozenset(FIELDS)
REQUIRED = tuple(field.name for field in ROW if field.required)


def fields_of(group: str) -> tuple[str, ...]:
    """The names of one group's fields, in the order a row has them."""
    if group not in GROUPS:
        raise ValueError(f"no group {group!r}; groups: {', '.join(GROUPS)}")
    return tuple(field.name for field in ROW if field.group == group)


# How the cache was stored; part of the store's key only where it was not the model's own (``results.stored_as``).
STORAGE = ("kv_native", "kv_bits", "kv_group", "kv_residual", "kv_format")
# What report.load_runs adds to each row it reads: the folder it came from, the storage as one label, and the
# policy with its bits and decode budget as figures' lines name it (axes.SERIES).
LOADED = ("folder", "kv_stored", "series")
# A row's key across run folders (report.load_runs): the model, the store's key, the storage as its label.
TABLE_KEY = ("model", *(name for name in fields_of(IDENTITY) if name not in ("model", *STORAGE)), "kv_stored")
# A cell, wherever results are pooled (the gate's cells, the exports' folders, merges' summaries): a row's key less
# its sample. The storage format (bits, group, residual: ``kv_stored``) and the decode budget are part of it, and so
# is the memory target: a memory budget is written as one (``mem0.05``). What a cell's column holds where a row
# written before that column does not say: the model's own cache, no cut while decoding, the question inside.
CELL_KEY = tuple(name for name in TABLE_KEY if name != "sample_id")
# A question of a sample, whichever cell answered it: a row's key less the cell's configuration.
SAMPLE_KEY = tuple(
    name for name in TABLE_KEY if name not in ("policy", "budget", "decode_budget", "turn_compression", "kv_stored")
)
CELL_DEFAULTS = {
    "query_mode": DEFAULT_QUERY_MODE,
    "decode_budget": "none",
    "turn_compression": NO_TURNS,
    "kv_stored": "",
}

# A row whose cache was stored in another format than the model's own (``kv_native`` false) carries its storage in
# its key, and writes it with the key: after the query mode, before the decode budget.
_STORED_ORDER = (*FIELDS[: FIELDS.index("decode_budget")], *STORAGE)
_STORED_ORDER += tuple(name for name in FIELDS if name not in _STORED_ORDER)


def arrange(values: dict[str, Any]) -> dict[str, Any]:
    """A row's schema fields (``values``, by name) in the order they are written; a name the schema does not declare
    is refused, so a new column cannot reach the rows without its line in ``ROW``."""
    unknown = [name for name in values if name not in _DECLARED]
    if unknown:
        raise KeyError(f"{', '.join(unknown)}: not a field of the result row; declare it in pkvbench/cell/schema.py")
    order = _STORED_ORDER if values.get("kv_native") is False else FIELDS
    return {name: values[name] for name in order if name in values}


# pkvbench funnel's per-head statistics (funnel.csv's columns, funnel_samples.jsonl's stats), each with what it means.
FUNNEL_STATISTICS = {
    "entropy": "entropy of the attention / log(keys it sees): 1 = uniform, 0 = one key",
    "top1pct_mass": "share of the attention on the top 1% of keys",
    "topk_mass": "share of the attention on the top k keys (k = --top-k)",
    "sink_mass": "share of the attention on the first s tokens (s = --sink)",
    "keys_for_90_frac": "fewest keys holding 90% of the attention, as a share of the keys seen",
    "keys_for_90": "fewest keys holding 90% of the attention",
}
