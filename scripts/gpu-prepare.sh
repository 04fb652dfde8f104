#!/usr/bin/env bash
# Run here (not on the GPU machine): builds braze's abi3 wheel into .braze-wheel/ and fetches
# the pure-Python test dependencies the GPU machine lacks into .whl/ (both git-ignored).
# Then call the device tool with carry [".braze-wheel", ".whl"] and command
# `bash scripts/gpu-run.sh`.
#
# BRAZE_AB="ref1 ref2 ..." also builds the wheel of each git ref (a branch under test, an
# older commit) into .braze-wheel/ab/<ref>/, from a temporary worktree: gpu-run.sh installs
# each into /tmp/site-<ref>, so one device call can time them against the working tree on
# the same machine (PYTHONPATH=/tmp/site-<ref> python3 benchmarks/model_host.py ...).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .braze-wheel && maturin build --release -o .braze-wheel >/dev/null
for ref in ${BRAZE_AB:-}; do
  wt=$(mktemp -d)
  git worktree add -q --detach "$wt" "$ref"
  (cd "$wt" && CARGO_TARGET_DIR=${BRAZE_AB_TARGET:-/tmp/braze-ab-target} maturin build --release -o "$OLDPWD/.braze-wheel/ab/$ref" >/dev/null)
  git worktree remove --force "$wt"
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl expecttest==0.3.0
# pytest-xdist: BRAZE_PYTEST_ARGS="-n 8" spreads a long suite (OpInfo) over the GPU machine's cores.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl pytest-xdist==3.8.0 execnet==2.1.2
ls .braze-wheel .whl
