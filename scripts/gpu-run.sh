#!/usr/bin/env bash
# Run on the GPU machine (the device tool), after scripts/gpu-prepare.sh here: installs the
# carried wheels, runs the whole test suite with CUDA inputs, then the benchmark. Logs and
# the benchmark's JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/braze-out}
mkdir -p "$OUT"
# pip --target keeps a package already there: a warm machine would go on running the wheel
# of an earlier call.
rm -rf /tmp/site /tmp/site-*
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .braze-wheel/*.whl || exit 1
# Wheels of other refs (gpu-prepare.sh's BRAZE_AB), each in its own site directory.
for w in .braze-wheel/ab/*/*.whl .braze-wheel/ab/*/*/*.whl; do
  [ -f "$w" ] || continue
  ref=$(dirname "${w#.braze-wheel/ab/}")
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-${ref//\//-}" .whl/*.whl "$w" || exit 1
  echo "braze of $ref: PYTHONPATH=/tmp/site-${ref//\//-}"
done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, braze; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'braze', braze.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${BRAZE_SKIP_TESTS:-0}" != "1" ]; then
  BRAZE_TEST_DEVICE=cuda timeout "${BRAZE_TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rf ${BRAZE_PYTEST_ARGS:-} ${BRAZE_TESTS:-tests} > "$OUT/tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|^op_db|^  " "$OUT/tests.log" | tail -n 40
fi
# The benchmark after the tests: CPU-bound work (the compile stages of first calls) ran several
# times slower in a freshly started machine's first minutes.
uptime >> "$OUT/gpu.txt"
if [ "${BRAZE_SKIP_BENCH:-0}" != "1" ]; then
  timeout "${BRAZE_BENCH_TIMEOUT:-480}" python3 -m braze.bench --json "$OUT/bench.json" ${BRAZE_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 20
fi
