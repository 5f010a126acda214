"""pkvbench: what KV-cache compression costs in accuracy, at what budget.

The Python API mirrors the command line::

    import pkvbench

    result = pkvbench.evaluate(pkvbench.RunConfig(tasks=["needle"], policies=["full", "pyramidkv"], budgets=[64],
                                                  lengths=[1000], depths=[50], out="results/runs/api-demo"))
    result.summary        # task × policy × budget (× query mode): n, score, interval
    result.rows           # one row per sample × configuration, as written to samples.jsonl

``evaluate`` and ``RunConfig`` are imported on first use, so ``import pkvbench`` stays light (no torch).
"""

from pkvbench._version import __version__

__all__ = ["EvalResult", "FunnelConfig", "RunConfig", "__version__", "evaluate", "measure_funnel"]

_API = {"evaluate", "RunConfig", "EvalResult", "FunnelConfig", "measure_funnel"}


def __getattr__(name: str):
    if name in _API:
        from pkvbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'pkvbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
