"""pkvbench as an lm-eval model backend, registered under the name ``pkvbench`` (lm-eval 0.4.x's ``TemplateLM``).

A thin layer: lm-eval's requests are tokenized as lm-eval's ``hf`` backend tokenizes them (``TemplateLM``'s
context/continuation split, the same truncation and stop strings) and handed to ``grid.Grid``, which answers each
under every configuration of the grid; this object returns one configuration's answers (``configuration``), so
``pkvbench lm-eval`` evaluates the grid as one view per configuration over one ``Grid`` (``run.py``), each request
computed once. Made by lm-eval itself (``lm_eval --model pkvbench --model_args ...``) it holds one configuration.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text

from pkvbench.errors import PkvError
from pkvbench.lm_eval.grid import Continuation, Generation, Grid, GridSpec

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's
DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf backend's, for a model that declares no window
# How to make a sampling task greedy, said to the user of lm-eval's own command line (``pkvbench lm-eval`` says its own)
GREEDY_HERE = "pass --gen_kwargs do_sample=false,temperature=0, or give a task that decodes greedily"
ROLLING_REFUSAL = (
    "loglikelihood_rolling (perplexity tasks) is not supported by the pkvbench backend: a rolling window has no "
    "context to compress; run the task with lm-eval's hf backend"
)


def greedy_settings(task: str, gen_kwargs: dict[str, Any], remedy: str = GREEDY_HERE) -> dict[str, Any]:
    """A generation request's settings, normalized as lm-eval's hf backend normalizes them; sampling is refused
    (pkvbench decodes greedily), ``remedy`` saying what to do instead."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
    if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
        raise PkvError(
            f"task {task}: sampling (do_sample, temperature > 0) is not supported: pkvbench decodes greedily; {remedy}"
        )
    return kwargs


def lm_eval_device(model_args: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's command line passes ``device=cuda:0`` unless told otherwise; its hf backend then takes CUDA where
    there is one, else the CPU. The same here (pkvbench's devices have no index)."""
    device = model_args.get("device")
    if isinstance(device, str) and device.startswith("cuda:"):
        import torch

        return {**model_args, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    return model_args


@register_model("pkvbench")
class PkvbenchLM(TemplateLM):
    """lm-eval's view of one configuration of a ``Grid``. ``lm_eval --model pkvbench`` passes model args (``model``
    or ``pretrained``, ``policy``, ``budget``, ``memory``, ``kv_bits``, ``decode_budget``, ``query_mode``,
    ``question_split``, ``device``, ``dtype``, ...; docs/lm-eval.md); ``pkvbench lm-eval`` passes the ``grid``."""

    def __init__(self, grid: Grid | None = None, configuration: int = 0, **model_args: Any):
        super().__init__()
        if grid is None:
            spec = GridSpec.parse(lm_eval_device(model_args))
            if len(spec.cells) > 1:
                raise PkvError(
                    f"the model args name a grid of {len(spec.cells)} configurations; lm-eval evaluates one model per "
                    "run: run the grid with `pkvbench lm-eval` (one prefill per request for all), or give one value each"
                )
            spec.check_model()  # before the model loads, as `pkvbench run` checks it
            grid = Grid(spec)
        self.grid = grid
        self.configuration = configuration
        self.tokenizer = grid.tokenizer
        self._device = grid.engine.device
        # per context answered: what was measured under this configuration (the compressed cache's size, and for a
        # generation the whole of runner.run_sample's row), for pkvbench's rows (run.documents)
        self.answered: dict[str, dict] = {}

    @property
    def label(self) -> str:
        return self.grid.labels[self.configuration]

    # --- what TemplateLM needs ---------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self.grid.spec.max_length:
            return self.grid.spec.max_length
        config = self.grid.engine.model.config
        return getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf backend encodes: the tokenizer's own special tokens, none before a string that already
        starts with the BOS token."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **options)

    def _question_at(self, context: str, ids: list[int]) -> int | None:
        """Where the question starts in ``ids`` (the context's tokens): at the last occurrence of ``question_split``,
        found as lm-eval splits a context from its continuation (the text before it encoded on its own)."""
        at = self.grid.spec.split_at(context)
        return None if at is None else min(len(self.tok_encode(context[:at])), len(ids))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        asked = []
        for (context, _), context_enc, continuation_enc in requests:
            # as the hf backend: the last max_length + 1 tokens, of which the last is only predicted
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :]
            kept_context = whole[: len(whole) - len(continuation_enc)]
            cut = self._question_at(context, context_enc)
            cut = None if cut is None else max(cut - (len(context_enc) - len(kept_context)), 0) or None
            asked.append(Continuation(tuple(kept_context), cut, tuple(continuation_enc)))
        answers = []
        for request, per_cell in zip(requests, self.grid.loglikelihood(asked)):
            result = per_cell[self.configuration]
            answer = (result["logprob"], result["greedy"])
            self.answered[request[0][0]] = {k: v for k, v in result.items() if k not in ("logprob", "greedy")}
            answers.append(answer)
            self.cache_hook.add_partial("loglikelihood", request[0], answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise PkvError(ROLLING_REFUSAL)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        asked, stops = [], []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = greedy_settings(request.task_name, gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)
            # as the hf backend: the context's last max_length − max_gen_toks tokens
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise PkvError(
                    f"task {request.task_name}: max_gen_toks {max_gen_toks} leaves no room for a context in "
                    f"{self.max_length} tokens"
                )
            kept = ids[-room:]
            cut = self._question_at(context, ids)
            cut = None if cut is None else max(cut - (len(ids) - len(kept)), 0) or None
            asked.append(Generation(tuple(kept), cut, max_gen_toks, tuple(until)))
            stops.append(until)
        answers = []
        for request, until, per_cell in zip(requests, stops, self.grid.generate(asked)):
            row = per_cell[self.configuration]
            text = postprocess_generated_text(row["pred"], until, None)
            self.answered[request.args[0]] = row
            answers.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return answers

    def get_model_info(self) -> dict:
        """What lm-eval's results record of the model (its ``config``)."""
        spec = self.grid.spec
        return {
            "model": spec.config.model,
            "pkvbench_configuration": self.label,
            "pkvbench_model_args": {k: v if not isinstance(v, list) else "+".join(v) for k, v in spec.args.items()},
        }
