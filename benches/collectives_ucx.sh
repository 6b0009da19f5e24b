#!/usr/bin/env bash
# Collectives over UCX shared memory (`ezero bench collectives --transport ucx`: one process per
# rank) beside gloo (../shared/peers/collectives.py, torch.distributed over loopback TCP) and
# `ucx_perftest` tag_bw point to point with the same UCX transports, alternating in each round.
#   bash benches/collectives_ucx.sh [ROUNDS]        (SIZES_MIB="16 64" NPROCS="2 4")
# Needs libucx0 and ucx-utils (apt) and the peers' venv (../shared/peers/setup.sh).
# Writes JSON lines and perftest logs under $OUT and prints the table
# (benches/collectives_ucx_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PEERS_PY:-/tmp/peers/venv/bin/python}
OUT=${OUT:-/tmp/ezero_bench/collectives_ucx}
SIZES_MIB=${SIZES_MIB:-"16 64"}
NPROCS=${NPROCS:-"2 4"}
EZ=./target/release/ezero
command -v ucx_perftest > /dev/null || { echo "ucx_perftest missing: apt install ucx-utils" >&2; exit 2; }
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl "$OUT"/*.json "$OUT"/perftest-*.txt
bytes=$(for s in $SIZES_MIB; do printf '%sM,' "$s"; done); bytes=${bytes%,}
[ -x "$EZ" ] || cargo build --release
port=13377
for round in $(seq 1 "${1:-2}"); do
  echo "round $round, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for n in $NPROCS; do
    $EZ bench collectives --transport ucx --nprocs "$n" --bytes "$bytes" >> "$OUT/ucx.jsonl"
  done
  # shellcheck disable=SC2086
  "$PY" ../shared/peers/collectives.py --world-sizes $NPROCS --sizes-mib $SIZES_MIB --repeats 3 \
    --json "$OUT/gloo-$round.json" > /dev/null
  for s in $SIZES_MIB; do
    size=$((s << 20)); port=$((port + 1))
    # The transports the UCX plane uses between workers (set in code there).
    export UCX_TLS=sysv,posix,cma,self
    ucx_perftest -t tag_bw -s "$size" -n 100 -p "$port" > /dev/null 2>&1 &
    server=$!
    sleep 0.5
    ucx_perftest 127.0.0.1 -t tag_bw -s "$size" -n 100 -p "$port" > "$OUT/perftest-$s-$round.txt" 2>&1
    wait "$server" || true
    unset UCX_TLS
  done
done
python3 benches/collectives_ucx_summary.py "$OUT"
