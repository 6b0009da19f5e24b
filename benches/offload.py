#!/usr/bin/env python3
"""NVMe offload, end to end: `ezero train` with its state on the tier against the same run in RAM,
back to back for several rounds (the order alternates), plus the disk's bandwidth from
`ezero bench io` (the engine and fio in the same run) for the disk floor.

Three shapes:
  compute  the ZeRO-3 benchmark GPT (4 layers, d_model 256, seq 128, 8 sequences per rank,
           3.3M parameters, 2 ranks): compute-bound, fits in RAM. Target: offloaded step at
           most 1.10x the in-RAM step, per placement (optimizer; optimizer + gradients;
           optimizer + parameters + gradients).
  io       a deep, narrow GPT with almost no tokens (d_model 256, 64 layers, 50.6M parameters,
           one sequence of 16 tokens, 1 rank, everything on the tier): I/O-bound. Target:
           step time at most 1.25x the larger of the disk floor (bytes read / read GB/s +
           bytes written / write GB/s, fio's medians) and the in-RAM step.
  1b       the issue's end-to-end run: a 1.01B-parameter GPT (20 layers, d_model 2048, one
           sequence of 64 tokens, 1 rank, 2 compute threads) under --memory-max 2GiB, which does
           not fit in RAM, so it runs only on the tier (4 steps, about 4 minutes a round).
           Targets: step at most 1.25x the larger of the disk floor and the step's own compute
           time (the summary's compute_s_per_step); peak RSS at most 2 GiB.

Reported per run: median step (steps after 2 warm-up), bytes read and written per parameter per
step, time waiting on the tier, peak RSS while training (VmHWM before the final
consolidation), and the param-sha256 (must equal the in-RAM run's).

    python3 benches/offload.py --dir /path/on/the/disk            # 3 rounds, ~6 min here
    python3 benches/offload.py --dir DIR --rounds 1 --shapes io
    python3 benches/offload.py --dir DIR --rounds 2 --shapes 1b --grad-clip 0
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EZERO = os.path.join(ROOT, "target", "release", "ezero")

SHAPES = {
    "compute": ["--d-model", "256", "--layers", "4", "--heads", "4", "--seq-len", "128",
                "--micro-batches", "16", "--micro-batch-size", "1", "--ranks", "2",
                "--stage", "3", "--steps", "12", "--replicate-every", "0"],
    "io": ["--d-model", "256", "--layers", "64", "--heads", "4", "--seq-len", "16",
           "--micro-batches", "1", "--micro-batch-size", "1", "--ranks", "1", "--stage", "3",
           "--steps", "4", "--replicate-every", "0"],
    "1b": ["--d-model", "2048", "--layers", "20", "--heads", "16", "--seq-len", "64",
           "--micro-batches", "1", "--micro-batch-size", "1", "--ranks", "1", "--stage", "3",
           "--steps", "4", "--memory-max", "2GiB", "--compute-threads", "2"],
}
PLACEMENTS = {
    "ram": [],
    "opt": ["--offload-optimizer", "nvme", "--offload-params", "none", "--offload-grads", "none"],
    "opt+grads": ["--offload-optimizer", "nvme", "--offload-params", "none",
                  "--offload-grads", "nvme"],
    "all": ["--offload-optimizer", "nvme", "--offload-params", "nvme", "--offload-grads", "nvme"],
}


def run(shape, placement, tier, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = [EZERO, "train", *SHAPES[shape], *extra, "--sample-tokens", "0", "--json", f.name]
        if placement != "ram":
            args += [*PLACEMENTS[placement], "--nvme-dir", tier]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        s = json.load(open(f.name))
    p = s["param_count"]
    return {
        "shape": shape, "placement": placement, "params": p,
        "step_s": s["step_time_median_s"],
        "read_b_per_param": s["nvme_read_bytes_per_step"] / p,
        "write_b_per_param": s["nvme_write_bytes_per_step"] / p,
        "read_bytes": s["nvme_read_bytes_per_step"],
        "write_bytes": s["nvme_write_bytes_per_step"],
        "io_wait_s": s["io_wait_s_per_step"],
        "compute_s": max(r["compute_s_per_step"] for r in s["ranks"]),
        "peak_rss_training_mib": s["peak_rss_training_bytes"] / 2**20,
        "peak_rss_mib": s["peak_rss_bytes"] / 2**20,
        "sha": s["param_sha256"],
    }


def disk(tier):
    out = subprocess.run([EZERO, "bench", "io", "--dir", tier, "--size", "2GiB", "--rounds", "3"],
                         check=True, capture_output=True, text=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    med = lambda tool, op: statistics.median(  # noqa: E731
        r["gb_per_s"] for r in rows if r["tool"] == tool and r["op"] == op)
    ref = next(r["tool"] for r in rows if r["tool"] != "ezero")
    return {"ref": ref, "read": med(ref, "read"), "write": med(ref, "write"),
            "ezero_read": med("ezero", "read"), "ezero_write": med("ezero", "write")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="tier directory on the disk to measure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["compute", "io"])
    ap.add_argument("--grad-clip", type=float,
                    help="passed to every run (ezero's default 1.0 otherwise); 0 turns clipping "
                         "off, which lets stage 3 with everything on the tier update each unit "
                         "in the backward")
    a = ap.parse_args()
    extra = [] if a.grad_clip is None else ["--grad-clip", str(a.grad_clip)]
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    d = disk(a.dir)
    print(f"disk ({d['ref']} medians): read {d['read']:.2f} GB/s, write {d['write']:.2f} GB/s; "
          f"engine: read {d['ezero_read']:.2f}, write {d['ezero_write']:.2f}")
    runs = []
    for r in range(a.rounds):
        for shape in a.shapes:
            order = {"compute": ["ram", "opt", "opt+grads", "all"], "io": ["ram", "all"],
                     "1b": ["all"]}[shape]
            if r % 2:
                order.reverse()
            for placement in order:
                runs.append(run(shape, placement, a.dir, extra))
                x = runs[-1]
                print(json.dumps({"round": r, **x}))
    for shape in a.shapes:
        rows = [x for x in runs if x["shape"] == shape]
        in_ram = [x["step_s"] for x in rows if x["placement"] == "ram"]
        shas = {x["sha"] for x in rows}
        if in_ram:
            base, against = statistics.median(in_ram), "RAM step"
            print(f"\n{shape}: {rows[0]['params']} params, in-RAM step {base:.3f} s, param-sha256 "
                  f"{'identical' if len(shas) == 1 else 'DIFFERENT'} across placements")
        else:
            # Too big for RAM: the step is held against its own compute time instead.
            base, against = statistics.median(x["compute_s"] for x in rows), "compute"
            print(f"\n{shape}: {rows[0]['params']} params, compute {base:.3f} s a step, "
                  f"param-sha256 {'identical' if len(shas) == 1 else 'DIFFERENT'} across rounds")
        for placement in sorted({x["placement"] for x in rows} - {"ram"}):
            xs = [x for x in rows if x["placement"] == placement]
            step = statistics.median(x["step_s"] for x in xs)
            rd = statistics.median(x["read_bytes"] for x in xs)
            wr = statistics.median(x["write_bytes"] for x in xs)
            floor = rd / (d["read"] * 1e9) + wr / (d["write"] * 1e9)
            line = (f"  {placement:9} step {step:.3f} s = {step / base:.2f}x {against}; "
                    f"read {statistics.median(x['read_b_per_param'] for x in xs):.1f} + write "
                    f"{statistics.median(x['write_b_per_param'] for x in xs):.1f} B/param; "
                    f"io wait {statistics.median(x['io_wait_s'] for x in xs):.3f} s; disk floor "
                    f"{floor:.3f} s; step / max(floor, {against}) "
                    f"{step / max(floor, base):.2f}; peak RSS while training "
                    f"{statistics.median(x['peak_rss_training_mib'] for x in xs):.0f} MiB, process "
                    f"{max(x['peak_rss_mib'] for x in xs):.0f} MiB (the largest)")
            print(line)
        if in_ram:
            print(f"  ram       peak RSS {statistics.median(x['peak_rss_training_mib'] for x in rows if x['placement'] == 'ram'):.0f} MiB")


if __name__ == "__main__":
    main()
