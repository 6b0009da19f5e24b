#!/usr/bin/env bash
# The chaos soak: the in-process harness over many seeds, then the process-level harness over
# many generated scenarios, one after the other (never beside another benchmark: both load every
# core, and a starved worker trips heartbeats). Writes target/chaos-soak/{inproc.log,procs.log,
# procs.json} and prints the lines BENCHMARKS.md records.
#
#   bash benches/chaos_soak.sh                 # 10000 in-process seeds, 200 process scenarios
#   CHAOS_SOAK_INPROC=3000 CHAOS_SOAK_PROCS=50 bash benches/chaos_soak.sh
#   CHAOS_PROC_TRANSPORT=ucx CHAOS_SOAK_INPROC=0 CHAOS_SOAK_PROCS=30 bash benches/chaos_soak.sh
#                                              # process faults over UCX shared memory
#   CHAOS_PROC_COORDINATORS=1 CHAOS_SOAK_INPROC=0 bash benches/chaos_soak.sh
#                                              # with faults of the leading coordinator
set -euo pipefail
cd "$(dirname "$0")/.."
inproc="${CHAOS_SOAK_INPROC:-10000}"
procs="${CHAOS_SOAK_PROCS:-200}"   # 0 skips a part
for v in "$inproc" "$procs"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "CHAOS_SOAK_INPROC/CHAOS_SOAK_PROCS must be counts, got '$v'" >&2; exit 2; }
done
out=target/chaos-soak
mkdir -p "$out"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; $(date -u +%F)"
cargo test --release --test chaos --test chaos_procs --no-run 2>&1 | tail -1

rc=0
if [ "$inproc" -gt 0 ]; then
  start=$SECONDS
  CHAOS_SEEDS="$inproc" cargo test --release --test chaos chaos_seeds -- --nocapture >"$out/inproc.log" 2>&1 || rc=1
  echo "in-process: $inproc seeds in $((SECONDS - start)) s ($([ $rc = 0 ] && echo passed || echo FAILED))"
  grep -E '^(soak|kills mid-round|network faults)' "$out/inproc.log" || true
  grep -E '^seed [0-9]+ failed' "$out/inproc.log" | head -20 || true
fi

prc=0
[ "$procs" -gt 0 ] || exit $rc
start=$SECONDS
CHAOS_PROC_SEEDS="$procs" CHAOS_PROC_REPORT="$out/procs.json" \
  cargo test --release --test chaos_procs scenarios -- --nocapture >"$out/procs.log" 2>&1 || prc=1
echo "processes: $procs scenarios in $((SECONDS - start)) s ($([ $prc = 0 ] && echo passed || echo FAILED))"
grep -E '^(netem|seed [0-9]+ failed)' "$out/procs.log" | head -20 || true
python3 - "$out/procs.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
t = r["totals"]
kinds = {k[len("injected_"):]: v for k, v in sorted(t.items()) if k.startswith("injected_")}
print("process totals: scenarios %d, failures %d, faults %s (skipped %d), recoveries %d, network retries %d, rebalances %d, documented stops %d"
      % (t["scenarios"], t["failures"], kinds, t["skipped"], t["recoveries"], t["network_retries"], t["rebalances"], t["documented_stops"]))
net = {k[len("net_"):]: v for k, v in sorted(t.items()) if k.startswith("net_")}
print("proxies: %s" % net)
rss = r["coordinator_rss_kib"]
print("coordinator RSS at the first step %d-%d KiB, at the end %d-%d KiB; largest growth in one scenario %d KiB"
      % (min(a for a, _ in rss), max(a for a, _ in rss), min(b for _, b in rss), max(b for _, b in rss), r["coordinator_rss_growth_kib_max"]))
h = r["harness_rss_kib_after_each"]
q = max(1, len(h) // 10)
print("harness RSS after the first tenth of the scenarios %d KiB (max), after the last tenth %d KiB (max)"
      % (max(h[:q]), max(h[-q:])))
PY
exit $((rc | prc))
