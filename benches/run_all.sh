#!/usr/bin/env bash
# Reproduces every table of BENCHMARKS.md end to end (about 65 minutes on 2 busy cores):
#   1. the peers venv (/tmp/peers/venv: torch 2.15 + deepspeed 0.19.8, cpu_adam JIT-built once),
#   2. cargo build --release,
#   3. Adam: ours vs torch fused / DeepSpeedCPUAdam, 6 rounds x {1M,16M,64M} x {1,2} threads,
#   4. training: ours ZeRO-3 vs FSDP2 / DeepSpeed ZeRO-3 at 2 and 4 ranks, 3 rounds x 30 steps,
#      plus 2 rounds x 3 steps for CPU seconds per step,
#   5. one rank, no communication: ours vs torch `single`, 5 alternating pairs,
#   6. NVMe offload: the tier's engine vs fio, offloaded vs in-RAM steps (TIER_DIR, on a disk),
#   7. bf16: our bf16 GEMM vs torch's, and the bf16 step vs FSDP2 with bf16 mixed precision,
#   8. the chaos soak: 3000 seeds of the in-process harness (about 2 minutes),
#   9. UCX: collectives vs gloo and ucx_perftest, and a training step over each data plane
#      (skipped without ucx_perftest: apt install libucx0 ucx-utils).
# Raw JSON and the tables go to $OUT (default /tmp/ezero_bench).
#
#   bash benches/run_all.sh
#   ROUNDS=5 ADAM_ROUNDS=10 OUT=/tmp/b bash benches/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ezero_bench}
ROUNDS=${ROUNDS:-3}
ADAM_ROUNDS=${ADAM_ROUNDS:-6}
mkdir -p "$OUT"
bash ../shared/peers/setup.sh
cargo build --release
python3 benches/compare_adam.py --rounds "$ADAM_ROUNDS" --no-build --out "$OUT/adam_runs.json" | tee "$OUT/adam.md"
python3 benches/compare_train.py --rounds "$ROUNDS" --no-build --out "$OUT/train_runs.json" | tee "$OUT/train.md"
python3 benches/compare_train.py --rounds 2 --steps 3 --no-build --out "$OUT/train_short.json" > /dev/null
python3 benches/compare_train.py --summarize "$OUT/train_runs.json" --short "$OUT/train_short.json" | tee "$OUT/train.md"
OUT="$OUT" bash benches/compare_single_rank.sh 5 | tee "$OUT/single.txt"
TIER_DIR=${TIER_DIR:-/var/tmp/ezero-tier}
mkdir -p "$TIER_DIR"
python3 benches/offload.py --dir "$TIER_DIR" --rounds "$ROUNDS" | tee "$OUT/offload.txt"
./target/release/ezero bench gemm --precision bf16 --rounds "$ROUNDS" --torch-python /tmp/peers/venv/bin/python | tee "$OUT/gemm_bf16.txt"
python3 benches/compare_bf16.py --rounds "$ROUNDS" --no-build | tee "$OUT/bf16.md"
/tmp/peers/venv/bin/pip install --quiet transformers
python3 benches/compare_hf.py --model gpt2 --rounds 2 --world-sizes 2 --no-build | tee "$OUT/hf_gpt2.md"
python3 benches/compare_hf.py --model smollm2 --rounds 2 --world-sizes 2 --no-build | tee "$OUT/hf_smollm2.md"
CHAOS_SEEDS=3000 cargo test --release --test chaos chaos_seeds 2>&1 | tee "$OUT/soak.txt"
if command -v ucx_perftest > /dev/null; then
  OUT="$OUT/collectives_ucx" bash benches/collectives_ucx.sh 2 | tee "$OUT/collectives_ucx.txt"
  OUT="$OUT/train_planes" bash benches/train_planes.sh 3 | tee "$OUT/train_planes.txt"
fi
