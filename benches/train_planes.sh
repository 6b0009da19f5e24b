#!/usr/bin/env bash
# A training step over each data plane: in-process ranks (`ezero train`), worker processes over
# TLS TCP and over UCX shared memory (`ezero launch --transport tcp|ucx`), at 2 and 4 ranks,
# alternating in each round. The default job (ZeRO-3), STEPS steps; the median step of each run.
#   bash benches/train_planes.sh [ROUNDS]      (NPROCS="2 4" STEPS=30 FLAGS="")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ezero_bench/train_planes}
NPROCS=${NPROCS:-"2 4"}
STEPS=${STEPS:-30}
FLAGS=${FLAGS:-}
EZ=./target/release/ezero
mkdir -p "$OUT"
rm -f "$OUT"/steps.tsv
[ -x "$EZ" ] || cargo build --release
median() { sed -n 's/.*median step \([0-9.]*\) s.*/\1/p' | tail -1; }
for round in $(seq 1 "${1:-3}"); do
  echo "round $round, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for n in $NPROCS; do
    # shellcheck disable=SC2086
    s=$($EZ train --ranks "$n" --steps "$STEPS" $FLAGS 2>&1 | median)
    printf 'in-process\t%s\t%s\n' "$n" "$s" | tee -a "$OUT/steps.tsv"
    for plane in tcp ucx; do
      # shellcheck disable=SC2086
      s=$($EZ launch --transport "$plane" --nprocs "$n" -- --steps "$STEPS" $FLAGS 2>&1 | median)
      printf '%s\t%s\t%s\n' "$plane" "$n" "$s" | tee -a "$OUT/steps.tsv"
    done
  done
done
python3 - "$OUT/steps.tsv" <<'PY'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    plane, n, s = line.split()
    runs[(int(n), plane)].append(float(s))
for n in sorted({k[0] for k in runs}):
    base = statistics.median(runs[(n, "in-process")])
    for plane in ("in-process", "tcp", "ucx"):
        v = runs.get((n, plane), [])
        if v:
            m = statistics.median(v)
            print(f"ranks {n}  {plane:<10}  median step {m:.4f} s  ({m / base:.2f}x in-process)  runs {v}")
PY
