#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: the Rust workspace's tests (text-IR golden
# tests, codegen compile tests) and the Python suite (OpInfo ops, models, fallbacks).
# Extra arguments go to pytest (e.g. --device cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace --quiet
${PYTHON:-python3} -m pytest -q -p no:cacheprovider tests "$@"
