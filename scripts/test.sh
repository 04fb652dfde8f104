#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: the Rust workspace's tests (text-IR golden
# tests, codegen compile tests), clippy, and the Python suite (OpInfo ops, models, fallbacks).
# Extra arguments go to pytest (e.g. --device cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace --quiet
# Lints: clippy's warnings fail the run (skipped, with a note, where clippy is not installed).
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets --quiet -- -D warnings
else
  echo "note: cargo clippy not installed; lints skipped" >&2
fi
${PYTHON:-python3} -m pytest -q -p no:cacheprovider tests "$@"
