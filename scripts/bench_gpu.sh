#!/usr/bin/env bash
# The GPU benchmark on a machine with CUDA, from a checkout, with nothing to download (scripts/bench_gpu.py builds
# random-weight models from configs/gpu/ on the device):
#
#     bash scripts/bench_gpu.sh                  # both shapes, 8k and 32k tokens; results/bench/gpu/bench_gpu.{csv,md}
#     bash scripts/bench_gpu.sh --models llama-3.2-1b --lengths 8192     # a quicker look
#     bash scripts/bench_gpu.sh --tiny           # no GPU needed: the tiny model on CPU, every check's code path
#
# Sized for under 8 minutes on one H100 or H200, unattended: exactness on the device first, the device-map check
# (--device-map's placement: half the tiny model's layers on cuda:0, half on the CPU, every policy, a KIVI cell and the
# cuts while decoding against all on cuda:0, and its cost), then per model the
# statistics, the grid (with its step under torch.cuda.set_sync_debug_mode("error")), decode per token beside the
# floor and kvpress's pipeline on the grid's cells (the peer row: run scripts/fetch_peer_wheels.sh first, where there is
# a network); the tables are rewritten after every model, so a run cut short keeps what it finished.
#
# It runs under .venv's Python if there is one, else python3 (a machine image with torch and transformers, where
# pkvbench runs from this checkout). OUT (if set) is where the tables go; a copy of the log goes beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-results/bench/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# --help and --tiny (the tiny model on the CPU: every check's code path, the device-map check with the disk's offload
# included, in a minute) need no GPU; the benchmark itself does.
case " $* " in
  *" --help "* | *" --tiny "*) ;;
  *) "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: bash scripts/bench_gpu.sh --tiny runs on CPU'" ;;
esac
# The peer row's kvpress, from the wheels scripts/fetch_peer_wheels.sh put beside this script (no network needed):
# installed without its pins into a folder of its own, which only the peer's process puts on its path.
if ls scripts/wheels/*.whl >/dev/null 2>&1; then
  export PKVBENCH_KVPRESS_PATH=${PKVBENCH_KVPRESS_PATH:-${TMPDIR:-/tmp}/pkvbench-kvpress}
  "$PYTHON" -m pip install -q --no-deps --no-index --upgrade --target "$PKVBENCH_KVPRESS_PATH" scripts/wheels/*.whl ||
    echo "kvpress's wheels did not install: the peer row will say it is skipped" >&2
fi
"$PYTHON" scripts/bench_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
