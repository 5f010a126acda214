#!/usr/bin/env bash
# A separate virtual environment with NVIDIA kvpress, for bench.py's optional kvpress row (item 6):
#
#     bash scripts/kvpress_env.sh                  # builds .venv-kvpress (ignored by git), prints its interpreter
#     python scripts/bench.py --kvpress-python .venv-kvpress/bin/python
#
# Separate because kvpress pins transformers<5.3 (kvpress 0.5.5), older than the transformers pkvbench's .venv
# uses; scripts/kvpress_grid.py runs there and never imports pkvbench. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${1:-${KVPRESS_VENV:-.venv-kvpress}}
# torch first, pinned: on CPU-only machines this is the CPU wheel; an unpinned torch may pull a multi-GB CUDA build.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# kvpress unpinned: pip picks the newest release and, from kvpress's own pins, the transformers it works with.
KVPRESS_SPEC=${KVPRESS_SPEC:-kvpress}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q "$KVPRESS_SPEC"
"$VENV/bin/python" -c "import importlib.metadata as m; print('kvpress', m.version('kvpress'), '| transformers', \
m.version('transformers'), '| torch', m.version('torch'))" >&2
echo "$(cd "$VENV" && pwd)/bin/python"
