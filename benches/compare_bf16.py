#!/usr/bin/env python3
"""Step time under bf16 mixed precision, side by side: our ZeRO-3 with `--precision bf16` against
FSDP2 (fully_shard per block, reshard after forward) with
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (benches/fsdp2_bf16.py), on the GPT
of benches/compare_train.py, and our fp32 run for reference. Runs alternate in a rotating order,
round after round, never two at once.

    python3 benches/compare_bf16.py --rounds 3 --world-sizes 2 4

Prints a markdown table (median over rounds of each run's median step, min–max) and writes the
records to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import compare_train as ct  # noqa: E402

ROOT = os.path.dirname(HERE)
WHO = ["ours_bf16", "fsdp2_bf16", "ours_fp32"]


def measure(args):
    ezero = args.ezero or os.path.join(ROOT, "target", "release", "ezero")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    tmpdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(tmpdir, exist_ok=True)
    records = []
    with benchlib.LoadSampler(1.0) as sampler:
        for rnd in range(args.rounds):
            for wi, ws in enumerate(args.world_sizes):
                k = (rnd + wi) % len(WHO)
                order = WHO[k:] + WHO[:k]
                rec = {"round": rnd, "ws": ws, "order": order}
                for who in order:
                    t0 = time.monotonic()
                    if who.startswith("ours"):
                        rec[who] = ct.run_ours(ezero, ws, args.steps, args.batch_per_rank, args.micro_batch_size,
                                               tmpdir, precision=who.split("_")[1])
                    else:
                        script = os.path.join(HERE, "fsdp2_bf16.py")
                        peer = lambda: ct.run_peer(args.python, args.peers, "fsdp2_full", ws, args.steps,  # noqa: E731
                                                   args.batch_per_rank, tmpdir, script=script)
                        try:
                            rec[who] = peer()
                        except RuntimeError as e:
                            # gloo's worker processes abort now and then (SIGABRT); one retry,
                            # recorded.
                            print(f"round {rnd} ws {ws} {who}: {e}; retrying once", flush=True)
                            rec[who] = peer()
                            rec[who]["retried_after"] = str(e)
                    rec[who]["load"] = sampler.window(t0, time.monotonic())
                    print(f"round {rnd} ws {ws} {who:<10} step {rec[who]['step_s'] * 1e3:7.1f} ms  "
                          f"loss {rec[who]['final_loss']:.3f}", flush=True)
                records.append(rec)
    data = {"machine": benchlib.machine_description(), "rounds": args.rounds, "steps": args.steps,
            "batch_per_rank": args.batch_per_rank, "records": records}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return data


def summarize(data):
    recs = data["records"]
    lines = [f"Machine: {data['machine']}. {data['rounds']} rounds, {data['steps']} steps per run, "
             f"{data['batch_per_rank']} sequences per rank per step.", "",
             "| ws | ours bf16 | FSDP2 bf16 | ours fp32 | ours bf16 / FSDP2 bf16 | ours bf16 / ours fp32 | final loss ours bf16 / FSDP2 bf16 |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for ws in sorted({r["ws"] for r in recs}):
        rs = [r for r in recs if r["ws"] == ws]
        ms = lambda w: [r[w]["step_s"] * 1e3 for r in rs]  # noqa: E731
        ratio = lambda a, b: [r[a]["step_s"] / r[b]["step_s"] for r in rs]  # noqa: E731
        loss = lambda w: statistics.median(r[w]["final_loss"] for r in rs)  # noqa: E731
        lines.append(f"| {ws} | {benchlib.med_range(ms('ours_bf16'))} | {benchlib.med_range(ms('fsdp2_bf16'))} | "
                     f"{benchlib.med_range(ms('ours_fp32'))} | {benchlib.med_range(ratio('ours_bf16', 'fsdp2_bf16'), '{:.2f}')} | "
                     f"{benchlib.med_range(ratio('ours_bf16', 'ours_fp32'), '{:.2f}')} | "
                     f"{loss('ours_bf16'):.3f} / {loss('fsdp2_bf16'):.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--out", default="/tmp/ezero_bench/bf16_runs.json")
    ap.add_argument("--ezero")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--python", default=os.environ.get("PEERS_PY", "/tmp/peers/venv/bin/python"))
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", os.path.join(ROOT, "..", "shared", "peers")))
    ap.add_argument("--summarize", metavar="JSON", help="print the table of an earlier run")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print(summarize(json.load(f)))
        return
    print(summarize(measure(args)))


if __name__ == "__main__":
    main()
