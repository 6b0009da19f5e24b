#!/usr/bin/env bash
# Collectives over QUIC (one process per rank, loopback, mTLS) vs gloo (torch.distributed, the
# peer baseline in ../shared/peers/collectives.py) vs the in-process transport, at 2 and 4
# ranks, same sizes, alternating in the same run; plus loopback TCP (iperf3, if installed), the
# single-core AES-256-GCM rate, gloo's CPU per byte (benches/gloo_cpu.py, for the ceiling that
# encryption sets), and the QUIC tuning knobs one at a time.
#   bash benches/collectives.sh [ROUNDS]        (SIZES_MIB="1 16 64" NPROCS="2 4" TUNING=1)
# Writes JSON lines under $OUT and prints a summary table (benches/collectives_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PEERS_PY:-/tmp/peers/venv/bin/python}
OUT=${OUT:-/tmp/ezero_bench/collectives}
SIZES_MIB=${SIZES_MIB:-"1 16 64"}
NPROCS=${NPROCS:-"2 4"}
EZ=./target/release/ezero
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl "$OUT"/*.json
bytes=$(for s in $SIZES_MIB; do printf '%sM,' "$s"; done); bytes=${bytes%,}
[ -x "$EZ" ] || cargo build --release
for round in $(seq 1 "${1:-2}"); do
  echo "round $round, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # Every round, so that the best AEAD rate comes from the same conditions as the transfers.
  $EZ bench collectives --aead | tee -a "$OUT/aead.jsonl"
  for n in $NPROCS; do
    $EZ bench collectives --transport quic --nprocs "$n" --bytes "$bytes" >> "$OUT/quic.jsonl" || echo "quic n=$n failed"
    $EZ bench collectives --transport local --nprocs "$n" --bytes "$bytes" >> "$OUT/local.jsonl" || echo "local n=$n failed"
  done
  # shellcheck disable=SC2086
  "$PY" ../shared/peers/collectives.py --world-sizes $NPROCS --sizes-mib $SIZES_MIB --repeats 3 \
    --json "$OUT/gloo-$round.json" > /dev/null
  # shellcheck disable=SC2086
  "$PY" benches/gloo_cpu.py --world-sizes $NPROCS --sizes-mib $SIZES_MIB --json "$OUT/gloo_cpu.jsonl" > /dev/null
  if command -v iperf3 > /dev/null; then
    iperf3 -s -1 -B 127.0.0.1 -p 5299 > /dev/null 2>&1 &
    sleep 0.5
    iperf3 -c 127.0.0.1 -p 5299 -t 5 -J > "$OUT/iperf-$round.json" || true
    wait || true
  fi
done
if [ "${TUNING:-1}" = 1 ]; then
  # One knob at a time off the tuned default, broadcast and all_gather at 2 processes, 64 MiB.
  for variant in tuned "--socket-buffer-bytes 0" "--no-gso" "--initial-mtu 4000 --max-udp-payload-bytes 4000" "--initial-mtu 1200 --max-udp-payload-bytes 1472"; do
    for round in 1 2; do
      args=(); [ "$variant" = tuned ] || read -r -a args <<< "$variant"
      $EZ bench collectives --transport quic --nprocs 2 --bytes 64M --ops broadcast,all_gather "${args[@]}" |
        sed "s/^{/{\"variant\":\"$variant\",/" >> "$OUT/tuning.jsonl" || echo "variant $variant failed"
    done
  done
fi
python3 benches/collectives_summary.py "$OUT"
