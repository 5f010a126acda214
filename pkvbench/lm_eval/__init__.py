"""lm-evaluation-harness under KV-cache compression (docs/lm-eval.md).

- ``backend.PkvbenchLM``: the lm-eval model backend ``pkvbench`` (imports lm-eval);
- ``grid``: lm-eval's requests answered under every configuration of a grid, one prefill per context (no lm-eval);
- ``run``: ``pkvbench lm-eval``, a grid evaluated in one lm-eval run, written per configuration.

lm-eval is an optional extra (``pip install 'pkvbench[lm-eval]'``), imported only by ``backend`` and ``run``.
"""

from __future__ import annotations

from typing import Any

from pkvbench.errors import PkvError

# ``pkvbench lm-eval``'s defaults where they are not ``pkvbench run``'s: lm-eval evaluates each configuration in a
# pass of its own, so by default the full cache alone (run's default grid is five policies); lm-eval's own bootstrap
# default is 100000 resamples per metric, where 1000 already estimate a standard error to within a few percent.
POLICY = "full"
BOOTSTRAP_ITERS = 1000
MISSING = "lm-eval is not installed: pip install 'pkvbench[lm-eval]' (lm-eval 0.4.x)"


def require_lm_eval() -> None:
    """One line instead of an ImportError when the extra is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise PkvError(MISSING) from None


def __getattr__(name: str) -> Any:
    # ``pkvbench.lm_eval:PkvbenchLM`` (the entry point) without importing lm-eval for ``grid``'s users
    if name == "PkvbenchLM":
        require_lm_eval()
        from pkvbench.lm_eval.backend import PkvbenchLM

        return PkvbenchLM
    raise AttributeError(name)
