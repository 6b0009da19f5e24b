#!/usr/bin/env bash
# The round trip through transformers that CI cannot run (PyPI's torch wheels and their CUDA
# dependencies are 2.5 GB, and the CPU-only index is not reachable from CI): our GPT-2, Llama
# (tied and untied) and Qwen2 exports load in transformers with no missing or unexpected keys and
# give our logits. Makes the peers' venv with transformers if it is missing (about 5 minutes),
# then runs `tests/hf_llama.rs::exports_load_in_transformers_with_our_logits` and fails if the
# test skipped.
#
#   bash benches/hf_round_trip.sh
#   EZERO_TRANSFORMERS_PYTHON=/path/to/python bash benches/hf_round_trip.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${EZERO_TRANSFORMERS_PYTHON:-/tmp/peers/venv/bin/python}"
if ! "$python" -c 'import torch, transformers, safetensors' >/dev/null 2>&1; then
  if [ -n "${EZERO_TRANSFORMERS_PYTHON:-}" ]; then
    echo "$python cannot import torch, transformers and safetensors" >&2
    exit 2
  fi
  NO_DEEPSPEED=1 bash ../shared/peers/setup.sh
  /tmp/peers/venv/bin/pip install -q transformers safetensors
fi
echo "python: $python ($("$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
EZERO_TRANSFORMERS_PYTHON="$python" cargo test --release --test integration \
  hf_llama::exports_load_in_transformers_with_our_logits -- --nocapture 2>&1 | tee "$log" | tail -5
if grep -q "^skipped" "$log"; then
  echo "the round trip skipped: see above" >&2
  exit 1
fi
grep -q "test result: ok. 1 passed" "$log"
