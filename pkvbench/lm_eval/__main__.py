"""``python -m pkvbench.lm_eval run --model pkvbench --model_args ... --tasks ...``: lm-eval's own command line with
the ``pkvbench`` backend registered, for lm-eval versions (0.4.13) whose ``lm_eval`` does not discover model
plug-ins through entry points (docs/lm-eval.md)."""

from pkvbench.lm_eval import require_lm_eval

if __name__ == "__main__":
    import sys

    from pkvbench.errors import PkvError

    try:
        require_lm_eval()
    except PkvError as exc:
        sys.exit(f"pkvbench: error: {exc}")
    from lm_eval.__main__ import cli_evaluate

    import pkvbench.lm_eval.backend  # noqa: F401  (registers the model "pkvbench")

    cli_evaluate()
