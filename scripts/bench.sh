#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the benchmark of the seed workloads on eager,
# TorchInductor and braze (GPU when there is one, else CPU). Arguments go to braze.bench.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
${PYTHON:-python3} -m braze.bench "$@"
