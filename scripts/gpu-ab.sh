#!/usr/bin/env bash
# Run on the GPU machine after `gpu-run.sh` installed the working tree's wheel in /tmp/site and
# a ref's (BRAZE_AB="REF" at gpu-prepare time) in /tmp/site-REF. Times workloads under braze in
# alternating processes, the ref's then the working tree's, N times each, so that a machine's
# drift during the call shows in both (one process per wheel left the thirty-ninth session's
# training A/B unresolved: rounds of one process ranged 4.0–4.7 ms).
#
#   bash scripts/gpu-ab.sh REF N WORK... [-- option_ab.py arguments]
#   bash scripts/gpu-ab.sh 7510fc9 3 mobilenet_v3_small:reduce-overhead:train
#
# WORK is option_ab.py's NAME:MODE:inf|train. Prints each process's back-to-back median per
# workload, then the median over the processes of each wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
ref=$1; n=$2; shift 2
work=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  work+=("$1"); shift
done
log=$(mktemp)
for i in $(seq "$n"); do
  for wheel in "$ref" new; do
    site=/tmp/site-$ref; [ "$wheel" = new ] && site=/tmp/site
    PYTHONPATH=$site python3 benchmarks/option_ab.py "${work[@]}" --variants braze --rounds 3 --steps 10 "${extra[@]}" 2>&1 \
      | awk -v w="$wheel" '/^== /{name=substr($0, 4); gsub(/ /, "_", name)} /back to back/{m=$NF; sub(/\)$/, "", m); print w, name, m}' | tee -a "$log"
  done
done
python3 - "$log" <<'PY'
import statistics, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    wheel, name, ms = line.split()
    runs[(name.replace("_", " "), wheel)].append(float(ms))
for (work, wheel), v in sorted(runs.items()):
    print(f"{work:50s} {wheel:10s} median {statistics.median(v):.3f} ms over {len(v)} processes: {' '.join(f'{x:.3f}' for x in v)}")
PY
rm -f "$log"
