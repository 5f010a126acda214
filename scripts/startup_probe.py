"""How long ``pkvbench run`` takes to reach its first prefill, and where that time goes.

    python scripts/startup_probe.py --out-json T.json --launched EPOCH_S -- run --task needle ... --out FOLDER

runs the ``pkvbench`` command given after ``--`` in this process, exactly as the console script does, and stops it
at its first prefill, writing the time of each phase to ``--out-json``. ``--launched`` is the wall-clock time
(``time.time()``) at which the caller started this process, so the interpreter's own start counts too;
``scripts/bench.py`` (the ``start-up`` row) passes it.

The phases are read off the real command by wrapping a few functions as their modules are imported (an import
hook): nothing is imported ahead of the command, so its imports cost what they cost in a user's run. Only the
standard library is imported here.

    python start       launch → this script's first line (interpreter and site packages)
    imports            → ``evaluate`` is called (the CLI, pkvbench's API and what it imports: torch, pandas, …)
    checks             → the samples are built (options parsed, the model's context window read, the folder locked)
    task build         ``samples_of``: the tokenizer loaded, every sample tokenized (before the model, so bad input
                       stops the run before the slow load)
    model: config      ``AutoConfig`` inside ``load_model`` (with the import of the model's configuration code)
    model: tokenizer   ``AutoTokenizer`` inside ``load_model`` (0 when the samples' tokenizer is reused)
    model: weights     ``AutoModelForCausalLM`` (with the import of the model's code; the weights are memory-mapped)
    model: other       the rest of ``load_model`` (finding the float copy, moving, installing the recorder)
    to first prefill   → the first ``Engine.prefill`` (run.json, the engine, the grid's plan, the progress bar)
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402  (after the first clock reading)
import functools  # noqa: E402
import importlib.abc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

marks: dict[str, float] = {}  # event → wall-clock time
spans: dict[str, float] = {}  # what → seconds inside it (first call)
loading = [False]  # inside load_model: the Auto* calls made there are the model's phases (earlier ones are checks)


def timed_call(what: str, function, on_enter=None, only_while_loading: bool = False):
    """``function``, recording the seconds of its first call as ``spans[what]`` (with ``only_while_loading``: its
    first call inside ``load_model``)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        first = what not in spans and (loading[0] or not only_while_loading)
        if first and on_enter:
            on_enter()
        started = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            if first:
                spans[what] = time.time() - started
                marks.setdefault(f"{what} end", time.time())

    return wrapper


def mark(event: str):
    return lambda: marks.setdefault(event, time.time())


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` is executed by its own loader."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patches.pop(name))
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # resources, source, … as the real loader has them
        return getattr(self.loader, name)


def wrap_class_method(cls, name: str, what: str) -> None:
    setattr(cls, name, staticmethod(timed_call(what, getattr(cls, name), only_while_loading=True)))


def patch_models(module) -> None:
    timed = timed_call("load_model", module.load_model)

    @functools.wraps(module.load_model)
    def load_model(*args, **kwargs):
        loading[0] = True
        try:
            return timed(*args, **kwargs)
        finally:
            loading[0] = False

    module.load_model = load_model


def patch_api(module) -> None:
    module.evaluate = timed_call("evaluate", module.evaluate, on_enter=mark("imports done"))
    module.samples_of = timed_call("task build", module.samples_of, on_enter=mark("checks done"))


def patch_generation(module, out_json: str) -> None:
    prefill = module.Engine.prefill

    def first_prefill(self, *args, **kwargs):
        marks["first prefill"] = time.time()
        report(out_json)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the start-up is measured; the rest of the run is not this probe's business
        return prefill(self, *args, **kwargs)

    module.Engine.prefill = first_prefill


def report(out_json: str) -> None:
    model = spans.get("load_model", 0.0)
    config, tokenizer, weights = (spans.get(k, 0.0) for k in ("model: config", "model: tokenizer", "model: weights"))
    phases = {
        "python start": STARTED - LAUNCHED,
        "imports": marks["imports done"] - STARTED,
        "checks": marks["checks done"] - marks["imports done"],
        "task build": spans["task build"],
        "model: config": config,
        "model: tokenizer": tokenizer,
        "model: weights": weights,
        "model: other": model - config - tokenizer - weights,
        "to first prefill": marks["first prefill"] - marks["load_model end"],
    }
    total = marks["first prefill"] - LAUNCHED
    modules = sorted(sys.modules)
    with open(out_json, "w") as file:
        json.dump({"total_s": total, "phases_s": phases, "modules": modules}, file)


def main() -> None:
    global LAUNCHED
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-json", required=True)
    parser.add_argument("--launched", type=float, help="time.time() when the caller started this process")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then pkvbench's arguments")
    args = parser.parse_args()
    LAUNCHED = args.launched or STARTED
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    sys.meta_path.insert(
        0,
        PatchAfterImport(
            {
                "pkvbench.api": patch_api,
                "pkvbench.engine.models": patch_models,
                "pkvbench.engine.generation": lambda module: patch_generation(module, args.out_json),
                "transformers.models.auto.configuration_auto": lambda m: wrap_class_method(
                    m.AutoConfig, "from_pretrained", "model: config"
                ),
                "transformers.models.auto.tokenization_auto": lambda m: wrap_class_method(
                    m.AutoTokenizer, "from_pretrained", "model: tokenizer"
                ),
                "transformers.models.auto.modeling_auto": lambda m: wrap_class_method(
                    m.AutoModelForCausalLM, "from_pretrained", "model: weights"
                ),
            }
        ),
    )
    from pkvbench.cli import cli

    sys.argv = ["pkvbench", *command]
    cli(command, prog_name="pkvbench")
    raise SystemExit("the run ended without a prefill (nothing to do in its --out?)")


LAUNCHED = STARTED

if __name__ == "__main__":
    main()
