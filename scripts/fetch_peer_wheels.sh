#!/usr/bin/env bash
# The wheels of the GPU benchmark's peer row, for a device with no network: NVIDIA kvpress and the one dependency it
# imports that a machine image with torch and transformers lacks (cachetools), pinned by hash, into scripts/wheels/
# (ignored by git). Run it where pip reaches PyPI, before the device call; bash scripts/bench_gpu.sh then installs
# them (--no-deps, beside the image's transformers; scripts/bench_gpu_peer.py says which shims that needs):
#
#     bash scripts/fetch_peer_wheels.sh          # then carry scripts/wheels/ to the device with the checkout
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$([ -x ../.venv/bin/python ] && echo ../.venv/bin/python || echo python3)}
mkdir -p wheels
cat > wheels/requirements.txt <<'PINS'
kvpress==0.5.5 --hash=sha256:900bdb175b546f19c844a8d40e9e7bc6bff7f302689821263d376e31ff62f07e
cachetools==5.5.2 --hash=sha256:d26a22bcc62eb95c3beabd9f1ee5e820d3d2704fe2967cbe350e20c8ffcd3f0a
PINS
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --require-hashes -r wheels/requirements.txt -d wheels
ls wheels/*.whl
