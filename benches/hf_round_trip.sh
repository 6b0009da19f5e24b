#!/usr/bin/env bash
# The round trip through transformers that CI cannot run (PyPI's torch wheels and their CUDA
# dependencies are 2.5 GB, and the CPU-only index is not reachable from CI): our GPT-2, Llama
# (tied and untied) and Qwen2 exports load in transformers with no missing or unexpected keys and
# give our logits, read RoPE's base as config.json says, and tokenize as tokenizer.json does
# with the config's eos and the chat template. Makes the peers' venv with transformers if it is
# missing (about 5 minutes), then runs `tests/hf_llama.rs::exports_load_in_transformers_with_our_logits`
# twice: with that Python's transformers (5.x), and with transformers 4.46 (and the tokenizers
# and huggingface_hub it needs) installed beside it under target/transformers-4 on PYTHONPATH,
# so both readers of config.json and tokenizer_config.json are checked. Fails if a pass skipped.
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
v4=target/transformers-4
if ! PYTHONPATH="$v4" "$python" -c 'import transformers; assert transformers.__version__.startswith("4.")' >/dev/null 2>&1; then
  "$python" -m pip install --quiet --target "$v4" --no-deps transformers==4.46.3 tokenizers==0.20.3 \
    huggingface_hub==0.26.2 requests==2.32.3 urllib3==2.2.3 idna==3.10 certifi==2024.8.30 \
    charset-normalizer==3.4.0
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for path in "" "$PWD/$v4"; do
  echo "transformers $(PYTHONPATH="$path" "$python" -c 'import transformers; print(transformers.__version__)')"
  PYTHONPATH="$path" EZERO_TRANSFORMERS_PYTHON="$python" cargo test --release --test integration \
    hf_llama::exports_load_in_transformers_with_our_logits -- --include-ignored --nocapture 2>&1 \
    | tee "$log" | tail -3
  if grep -q "^skipped" "$log"; then
    echo "the round trip skipped: see above" >&2
    exit 1
  fi
  grep -q "test result: ok. 1 passed" "$log"
done
