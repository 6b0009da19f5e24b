#!/usr/bin/env bash
# One rank, no communication: our ZeRO-3 executor at --ranks 1 (one micro-batch of 8 sequences)
# vs the peer script's plain `single` mode with 1 torch thread, same model shape and batch, 30
# steps, alternating. Separates model compute from ZeRO/communication costs.
#   bash benches/compare_single_rank.sh [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PEERS_PY:-/tmp/peers/venv/bin/python}
OUT=${OUT:-/tmp/ezero_bench}
mkdir -p "$OUT"
for i in $(seq 1 "${1:-2}"); do
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "ours: cpu %U+%S s, wall %e s" ./target/release/ezero train --model gpt --layers 4 \
    --d-model 256 --heads 4 --seq-len 128 --stage 3 --ranks 1 --micro-batches 1 --micro-batch-size 8 \
    --steps 30 --sample-tokens 0 --grad-clip 0 --lr 1e-3 --warmup-steps 0 --replicate-every 0 --json "$OUT/ours-ws1-$i.json" 2>&1 |
    grep -E "^done|^ours"
  /usr/bin/time -f "torch single: cpu %U+%S s, wall %e s" "$PY" ../shared/peers/train_fsdp.py --modes single \
    --world-sizes 1 --threads 1 --steps 30 --warmup 2 --json "$OUT/peer-single-$i.json" 2>&1 | grep -E "^single |^torch"
  python3 -c "import json,sys; r=json.load(open('$OUT/peer-single-$i.json'))['runs'][0]; print(f\"torch single: median step {r['step_s_median']:.3f} s (fastest {r['step_s_min']:.3f} s)\")"
done
