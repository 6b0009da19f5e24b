#!/usr/bin/env python3
"""The device tier's ZeRO-Offload schedule on the simulated device (`--device sim`).

One run of `ezero train` at ZeRO stage 3 (bf16 unless --precision says otherwise), optimizer
and fp32 masters on the host, the device's memory capped by --device-memory-max. Reported
from the run's JSON summary:

- bytes moved host<->device per parameter per step, against ZeRO-Offload's 4+2 (DeepSpeed:
  fp32 gradients down, 16-bit parameters up) and the paper's 2+2;
- the median step time against max(compute, copies at the modeled bandwidth) (target <= 1.15x);
- the process's peak RSS and the device peak, beside the model's state size.

The issue's target shape is a GPT of at least 1B parameters with --device-memory-max 2GiB
(`--layers 24 --d-model 1792` is 0.93B plus embeddings); on a small machine pass a smaller
shape and say so. Run it alone on the machine:

    python3 benches/device_tier.py --layers 24 --d-model 1792 \
        --device-memory-max 2GiB --steps 2
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ezero", default="target/release/ezero", help="the binary [target/release/ezero]")
    ap.add_argument("--layers", type=int, default=24, help="GPT layers [24]")
    ap.add_argument("--d-model", type=int, default=1792, help="GPT width [1792]")
    ap.add_argument("--heads", type=int, default=14, help="attention heads [14]")
    ap.add_argument("--seq-len", type=int, default=64, help="sequence length [64]")
    ap.add_argument("--steps", type=int, default=2, help="steps (the median is over all) [2]")
    ap.add_argument("--device-memory-max", default="2GiB", help="the device budget [2GiB]")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="modeled link GB/s [25]")
    ap.add_argument("--precision", default="bf16", help="bf16 or fp32 [bf16]")
    ap.add_argument("--extra", default="", help='more ezero train flags, as one string: --extra="--offload-optimizer nvme --nvme-dir DIR"')
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "s.json")
        cmd = [
            a.ezero, "train", "--model", "gpt", "--stage", "3", "--ranks", "1",
            "--precision", a.precision, "--layers", str(a.layers), "--d-model", str(a.d_model),
            "--heads", str(a.heads), "--seq-len", str(a.seq_len),
            "--micro-batches", "1", "--micro-batch-size", "1", "--steps", str(a.steps),
            "--max-live-units", "2", "--sample-tokens", "0", "--warmup-steps", "1",
            "--device", "sim", "--device-memory-max", a.device_memory_max,
            "--sim-link-gbps", str(a.link_gbps), "--json", js,
        ] + shlex.split(a.extra)
        print("command:", " ".join(cmd), flush=True)
        t0 = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        if out.returncode != 0:
            sys.stderr.write(out.stdout + out.stderr)
            sys.exit(out.returncode)
        s = json.load(open(js))
    d = s["device"]
    psi = s["param_count"]
    r = s["ranks"][0]
    up, down = d["h2d_bytes_per_step"] / psi, d["d2h_bytes_per_step"] / psi
    copies_s = (d["h2d_bytes_per_step"] + d["d2h_bytes_per_step"]) / (a.link_gbps * 1e9)
    compute_s = r["compute_s_per_step"]
    step_s = s["step_time_median_s"]
    floor = max(compute_s, copies_s)
    # Host state: fp32 master (4), Adam m and v (8), the reduced fp32 gradient shard (4).
    state = psi * 16
    res = {
        "params": psi,
        "h2d_bytes_per_param": round(up, 3),
        "d2h_bytes_per_param": round(down, 3),
        "precision": a.precision,
        "zero_offload_deepspeed": "2 up + 4 down",
        "zero_offload_paper": "2 up + 2 down",
        "step_s": round(step_s, 3),
        "compute_s": round(compute_s, 3),
        "optimizer_s": round(r["optimizer_s_per_step"], 3),
        # The rest of the step: gathers and reduce-scatters (one rank: the host's copies of
        # its own shard), the agreement round and the coordinator's round trip.
        "collectives_s": round(r["collectives_s_per_step"], 3),
        "outside_s": round(r["outside_s_per_step"], 3),
        "copies_at_link_s": round(copies_s, 4),
        "copy_wait_s": round(d["copy_wait_s_per_step"], 4),
        "step_over_max_compute_copies": round(step_s / floor, 3) if floor > 0 else None,
        "peak_rss_bytes": s["peak_rss_training_bytes"] or s["peak_rss_bytes"],
        "device_peak_bytes": d["peak_bytes"],
        "device_budget_bytes": d["memory_max_bytes"],
        "state_bytes": state,
        "state_over_device_budget": round(state / d["memory_max_bytes"], 1),
        "wall_s": round(wall, 1),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
