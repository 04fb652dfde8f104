#!/usr/bin/env bash
# Run here (not on the GPU machine): builds braze's abi3 wheel into .braze-wheel/ and fetches
# the pure-Python test dependencies the GPU machine lacks into .whl/ (both git-ignored).
# Then call the device tool with carry [".braze-wheel", ".whl"] and command
# `bash scripts/gpu-run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .braze-wheel && maturin build --release -o .braze-wheel >/dev/null
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl expecttest==0.3.0
ls .braze-wheel .whl
