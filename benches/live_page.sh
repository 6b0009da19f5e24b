#!/usr/bin/env bash
# The live page of the control endpoint, seen by a browser: runs a job with --control (3 ranks,
# one leaving partway, a held-out evaluation every 20 steps), opens GET / in headless Chromium
# once LIVE_PAGE_STEPS steps are in, writes the screenshot and stops the job (SIGTERM: the page
# needs the endpoint, which lives as long as the job). Look at the PNG: the loss, eval loss,
# learning-rate and throughput curves should be drawn, with the membership change marked.
#
#   bash benches/live_page.sh                      # writes target/live-page/page.png
#   EZERO=target/debug/ezero bash benches/live_page.sh
#
# Needs chromium (`apt-get install -y chromium`). Run it under the benchmark lock, as every
# benchmark here: `flock /tmp/bench.lock bash benches/live_page.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/live-page
mkdir -p "$out"
ezero="${EZERO:-target/release/ezero}"
if [ ! -x "$ezero" ]; then
  cargo build --release --bin ezero 2>&1 | tail -1
fi
browser="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$browser" ] || { echo "needs chromium: apt-get install -y chromium" >&2; exit 2; }

# Held-out text that differs from the training text.
eval_txt="$out/eval.txt"
for _ in $(seq 40); do echo "a lazy dog sleeps while the quick fox runs on; "; done >"$eval_txt"
train_txt="$out/train.txt"
for _ in $(seq 200); do echo "the quick brown fox jumps over the lazy dog. "; done >"$train_txt"

want="${LIVE_PAGE_STEPS:-200}"
[[ "$want" =~ ^[0-9]+$ ]] && [ "$want" -ge 10 ] || { echo "LIVE_PAGE_STEPS must be a count of at least 10, got '$want'" >&2; exit 2; }
"$ezero" train --model gpt --layers 2 --d-model 64 --heads 4 --seq-len 32 --micro-batches 4 \
  --steps 100000 --ranks 3 --leave "2@$((want / 3))" --warmup-steps 20 \
  --data "$train_txt" --eval-data "$eval_txt" --eval-every 20 --sample-tokens 0 \
  --control 127.0.0.1:0 >"$out/train.log" 2>&1 &
job=$!
trap 'kill "$job" 2>/dev/null || true' EXIT

addr=""
for _ in $(seq 600); do
  addr="$(sed -n 's|^control endpoint: http://\([^ ]*\) .*|\1|p' "$out/train.log" | head -1)"
  [ -n "$addr" ] && break
  kill -0 "$job" 2>/dev/null || { cat "$out/train.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "no control endpoint line in $out/train.log" >&2; exit 1; }

# Wait until the history has the steps asked for (the membership change included).
for _ in $(seq 2400); do
  n="$(curl -sf "http://$addr/history" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["steps"]))' 2>/dev/null || echo 0)"
  [ "$n" -ge "$want" ] && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.25
done
curl -sf "http://$addr/history" >"$out/history.json" || true
echo "history: $(python3 -c 'import json,sys; h=json.load(open(sys.argv[1])); print(len(h["steps"]), "steps,", len(h["events"]), "events,", sum(1 for s in h["steps"] if "eval_loss" in s), "evaluations")' "$out/history.json")"

"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1000,760 --virtual-time-budget=4000 \
  --screenshot="$out/page.png" "http://$addr/" 2>"$out/chromium.log" || { cat "$out/chromium.log" >&2; exit 1; }
kill -TERM "$job"
wait "$job" || true
trap - EXIT
echo "screenshot: $out/page.png ($(stat -c %s "$out/page.png") bytes)"
