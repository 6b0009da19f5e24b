#!/usr/bin/env python3
"""End-to-end ZeRO-3 step time and memory: `ezero train --stage 3` vs PyTorch FSDP2 (`fully_shard`,
reshard_after_forward=True) and DeepSpeed ZeRO-3, run by ../shared/peers/train_fsdp.py.

Same model shape on both sides (pre-LN GPT, 4 layers, d_model 256, 4 heads, seq 128, byte vocab,
untied head: 3,323,392 params), same global batch (8 sequences per rank: G = 16 at 2 ranks, 32 at
4), AdamW betas (0.9, 0.95), wd 0.1, fp32, no clipping, 30 steps. For every round and world size
it runs ours, FSDP2 and DeepSpeed ZeRO-3 back to back (the order rotates each round) while a
sampler records how much CPU other processes used.

Threads: the peer script gives each rank cpu_count // ws torch threads (1 at ws 2 and at ws 4).
Our ranks are one compute thread each (single-threaded GEMM, --optimizer-threads 1), plus a
2-thread tokio runtime that only routes messages. Both sides therefore run ws compute threads
on the 2 cores.

Activations: ours runs with its default, activation_checkpointing = auto, which keeps each
block's intermediates (as the peers do) when they fit the memory budget, as they do on this
shape; --activation-checkpointing always makes ours recompute them.

Step time: both sides report the median over steps 3..30 (ours skips 2 warm-up steps; the peer
script is passed --warmup 2), where a step is forward + backward + optimizer and its time is the
slowest rank's (ours: the coordinator's step wall time, which also includes the step's
coordination round trip).

Fault tolerance: ours runs with --replicate-every 0 (no buddy backups) unless --replicate-every K
is given: the peers keep no backups either, and ezero's default (a backup of every rank's state to
its buddy after every step) would add that copy to our step.

Memory: the peers' figure is each rank process's peak RSS (VmHWM, including ~0.7 GiB of torch
libraries), and peak - RSS after init_process_group; we sum both over ranks. Ours is one process
holding all ranks: its peak RSS from /usr/bin/time -v (Maximum resident set size), and the sum
over ranks of our memory ledger's peak (parameters, gradients, optimizer state, gathered units,
activations; no allocator or library overhead).

    python3 benches/compare_train.py                        # 3 rounds x ws 2, 4; ~12 min
    python3 benches/compare_train.py --rounds 1 --world-sizes 2
    python3 benches/compare_train.py --summarize /tmp/ezero_bench/train_runs.json
    # CPU seconds per step (cancels start-up): a second, short run, then both together
    python3 benches/compare_train.py --rounds 2 --steps 3 --out /tmp/ezero_bench/train_short.json
    python3 benches/compare_train.py --summarize /tmp/ezero_bench/train_runs.json --short /tmp/ezero_bench/train_short.json
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in benches/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(layers=4, d_model=256, heads=4, seq=128)
PEER_MODES = ["fsdp2_full", "ds_zero3"]


def cpu_seconds(time_v_stderr):
    """User + system CPU seconds of the whole process tree, from /usr/bin/time -v."""
    u = re.search(r"User time \(seconds\): ([\d.]+)", time_v_stderr)
    k = re.search(r"System time \(seconds\): ([\d.]+)", time_v_stderr)
    return float(u.group(1)) + float(k.group(1)) if u and k else None


def run_ours(ezero, ws, steps, per_rank, mb_size, tmpdir, replicate_every=0, activations=None, precision=None):
    """Our ZeRO-3 run with M micro-batches of B sequences, M*B = per_rank*ws."""
    g = per_rank * ws
    m = g // mb_size
    out = os.path.join(tmpdir, f"ours-ws{ws}.json")
    cmd = ["/usr/bin/time", "-v", ezero, "train", "--model", "gpt", "--layers", str(SHAPE["layers"]),
           "--d-model", str(SHAPE["d_model"]), "--heads", str(SHAPE["heads"]), "--seq-len", str(SHAPE["seq"]),
           "--stage", "3", "--ranks", str(ws), "--micro-batches", str(m), "--micro-batch-size", str(mb_size),
           "--steps", str(steps), "--sample-tokens", "0", "--grad-clip", "0", "--lr", "1e-3",
           "--warmup-steps", "0", "--replicate-every", str(replicate_every), "--json", out]
    if activations:
        cmd[-2:-2] = ["--activation-checkpointing", activations]
    if precision:
        cmd[-2:-2] = ["--precision", precision]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ezero train failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(out) as f:
        s = json.load(f)
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", p.stderr).group(1)
    # The progress lines (every steps/10 steps) give those steps' times: tokens / (tok/s).
    tokens = g * SHAPE["seq"]
    sampled = [(int(a), tokens / float(b)) for a, b in
               re.findall(r"^step\s+(\d+)/\d+ .*?(\d+) tok/s", p.stdout, re.M)]
    sampled = [t for step, t in sampled if step > 2]
    return {"cmd": " ".join(cmd[2:]), "micro_batches": m, "micro_batch_size": mb_size,
            "param_count": s["param_count"], "step_s": s["step_time_median_s"], "tokens_per_s": s["tokens_per_s"],
            "step_s_min_sampled": min(sampled) if sampled else None, "cpu_s": cpu_seconds(p.stderr),
            "final_loss": s["final_loss"], "process_peak_rss_mib": rss_kib / 1024,
            "ledger_peak_mib_sum": sum(r["peak_bytes"] for r in s["ranks"]) / 2**20,
            "ledger_peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in s["ranks"]],
            "resident_mib_per_rank": [sum(r["resident_bytes"].values()) / 2**20 for r in s["ranks"]],
            "wall": wall}


def run_peer(py, peers, mode, ws, steps, per_rank, tmpdir, script=None):
    out = os.path.join(tmpdir, f"peer-{mode}-ws{ws}.json")
    script = script or os.path.join(peers, "train_fsdp.py")
    cmd = ["/usr/bin/time", "-v", py, script, "--modes", mode, "--world-sizes", str(ws),
           "--steps", str(steps), "--warmup", "2", "--batch-per-rank", str(per_rank), "--json", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(out) as f:
        r = json.load(f)["runs"][0]
    if "error" in r:
        raise RuntimeError(f"{mode} ws {ws}: {r['error']}")
    peak, init = r["peak_rss_mib_per_rank"], r["rss_after_init_mib_per_rank"]
    return {"param_count": r["params"], "step_s": r["step_s_median"], "step_s_min": r["step_s_min"],
            "tokens_per_s": r["tokens_per_s"], "threads_per_rank": r["threads_per_rank"],
            "cpu_s": cpu_seconds(p.stderr),
            "final_loss": r["final_loss"], "peak_rss_mib_sum": sum(peak),
            "peak_minus_init_mib_sum": sum(p - i for p, i in zip(peak, init)),
            "peak_rss_mib_per_rank": peak}


def measure(args):
    ezero = args.ezero or os.path.join(ROOT, "target", "release", "ezero")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    tmpdir = os.path.dirname(os.path.abspath(args.out))
    records = []
    t_start = time.time()
    who_all = ["ours"] + PEER_MODES
    with benchlib.LoadSampler(1.0) as sampler:
        for rnd in range(args.rounds):
            for wi, ws in enumerate(args.world_sizes):
                k = (rnd + wi) % len(who_all)
                order = who_all[k:] + who_all[:k]
                rec = {"round": rnd, "ws": ws, "order": order}
                for who in order:
                    t0 = time.monotonic()
                    if who == "ours":
                        rec["ours"] = run_ours(ezero, ws, args.steps, args.batch_per_rank, args.micro_batch_size, tmpdir,
                                              args.replicate_every, args.activation_checkpointing)
                    else:
                        rec[who] = run_peer(args.python, args.peers, who, ws, args.steps, args.batch_per_rank, tmpdir)
                    rec[who]["load"] = sampler.window(t0, time.monotonic())
                    print(f"round {rnd} ws {ws} {who:<10} step {rec[who]['step_s']*1e3:7.1f} ms  "
                          f"foreign cores {rec[who]['load']['foreign_cores_mean'] or 0:.2f}", flush=True)
                records.append(rec)
        overall = sampler.overall()
    data = {"machine": benchlib.machine_description(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)), "rounds": args.rounds,
            "steps": args.steps, "batch_per_rank": args.batch_per_rank, "micro_batch_size": args.micro_batch_size,
            "load": overall, "records": records}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return data


def cpu_per_step(data, short):
    """CPU seconds per step: (median CPU of the long runs - median CPU of the short runs) /
    (difference in steps), which cancels start-up (Python imports, process groups, model init)."""
    lines = [f"CPU time per step (user + system over all processes and threads), seconds: (median CPU of the "
             f"{data['steps']}-step runs − median CPU of the {short['steps']}-step runs) / {data['steps'] - short['steps']}. "
             f"Less sensitive to the load than wall time. {short['rounds']} short rounds.\n",
             "| ws | ours | FSDP2 full | DeepSpeed ZeRO-3 | ours/FSDP2 | ours/DS |", "|---:|---:|---:|---:|---:|---:|"]
    for ws in sorted({r["ws"] for r in data["records"]}):
        per = {}
        for w in ["ours"] + PEER_MODES:
            long_ = statistics.median(r[w]["cpu_s"] for r in data["records"] if r["ws"] == ws)
            short_ = statistics.median(r[w]["cpu_s"] for r in short["records"] if r["ws"] == ws)
            per[w] = (long_ - short_) / (data["steps"] - short["steps"])
        lines.append(f"| {ws} | {per['ours']:.2f} | {per['fsdp2_full']:.2f} | {per['ds_zero3']:.2f} | "
                     f"{per['ours'] / per['fsdp2_full']:.2f} | {per['ours'] / per['ds_zero3']:.2f} |")
    return "\n".join(lines)


def summarize(data):
    recs = data["records"]
    load = data.get("load", {})
    wss = sorted({r["ws"] for r in recs})
    lines = [f"Machine: {data['machine']}. Started {data['started']}, {data['rounds']} rounds, {data['steps']} steps per run, "
             f"{data['batch_per_rank']} sequences per rank per step (ours: micro-batches of {data['micro_batch_size']}).",
             f"Load: other processes used a median {load.get('foreign_cores_median', float('nan')):.2f} "
             f"(p90 {load.get('foreign_cores_p90', float('nan')):.2f}) of the 2 cores; 1-min load average "
             f"{load.get('load1_min', float('nan')):.1f}–{load.get('load1_max', float('nan')):.1f} "
             f"(median {load.get('load1_median', float('nan')):.1f}).", ""]
    lines.append("Step time, ms: median over rounds (min–max) of each run's median step (steps 3..30).\n")
    lines.append("| ws | G | ours ZeRO-3 | FSDP2 full | DeepSpeed ZeRO-3 | ours/FSDP2 | ours/DS | target ≤ 0.8× both | foreign cores |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    verdict = []
    for ws in wss:
        rs = [r for r in recs if r["ws"] == ws]
        o = [r["ours"]["step_s"] * 1e3 for r in rs]
        f = [r["fsdp2_full"]["step_s"] * 1e3 for r in rs]
        d = [r["ds_zero3"]["step_s"] * 1e3 for r in rs]
        rf = [r["ours"]["step_s"] / r["fsdp2_full"]["step_s"] for r in rs]
        rd = [r["ours"]["step_s"] / r["ds_zero3"]["step_s"] for r in rs]
        fc = [r[w]["load"]["foreign_cores_mean"] for r in rs for w in ["ours"] + PEER_MODES
              if r[w]["load"].get("foreign_cores_mean") is not None]
        worst = max(statistics.median(rf), statistics.median(rd))
        ok = "met" if worst <= 0.8 else f"not met (need ≤ 0.80, at {worst:.2f})"
        verdict.append((ws, statistics.median(rf), statistics.median(rd)))
        lines.append(f"| {ws} | {data['batch_per_rank'] * ws} | {benchlib.med_range(o)} | {benchlib.med_range(f)} | "
                     f"{benchlib.med_range(d)} | {benchlib.med_range(rf, '{:.2f}')} | {benchlib.med_range(rd, '{:.2f}')} | "
                     f"{ok} | {benchlib.med_range(fc, '{:.2f}')} |")
    lines.append("")
    lines.append("Fastest step, ms (the least-disturbed step: min over rounds; peers: fastest of steps 3..30; "
                 "ours: fastest of the steps the progress log prints, every 3rd step).\n")
    lines.append("| ws | ours ZeRO-3 | FSDP2 full | DeepSpeed ZeRO-3 | ours/FSDP2 | ours/DS |")
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for ws in wss:
        rs = [r for r in recs if r["ws"] == ws]
        ob = [r["ours"].get("step_s_min_sampled") for r in rs if r["ours"].get("step_s_min_sampled")]
        if not ob:
            continue
        o, f, d = min(ob) * 1e3, min(r["fsdp2_full"]["step_s_min"] for r in rs) * 1e3, min(r["ds_zero3"]["step_s_min"] for r in rs) * 1e3
        lines.append(f"| {ws} | {o:.0f} | {f:.0f} | {d:.0f} | {o / f:.2f} | {o / d:.2f} |")
    lines.append("")
    lines.append("CPU time of the whole run (user + system, all processes and threads, /usr/bin/time), seconds: median over rounds. "
                 "The peers' figure includes Python start-up, imports and process-group set-up.\n")
    lines.append("| ws | ours | FSDP2 full | DeepSpeed ZeRO-3 |")
    lines.append("|---:|---:|---:|---:|")
    for ws in wss:
        rs = [r for r in recs if r["ws"] == ws]
        c = lambda w: benchlib.med_range([r[w].get("cpu_s") for r in rs], "{:.1f}")  # noqa: E731
        lines.append(f"| {ws} | {c('ours')} | {c('fsdp2_full')} | {c('ds_zero3')} |")
    lines.append("")
    lines.append("Memory, MiB (median over rounds). Peers: sum over rank processes of peak RSS (VmHWM) and of "
                 "peak − RSS after init. Ours: the single process's peak RSS (/usr/bin/time -v) and the sum over ranks of the ledger's peak.\n")
    lines.append("| ws | ours process peak RSS | ours ledger peak (Σ ranks) | FSDP2 Σ peak RSS | FSDP2 Σ (peak − init) | DS ZeRO-3 Σ peak RSS | DS Σ (peak − init) |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    for ws in wss:
        rs = [r for r in recs if r["ws"] == ws]
        med = lambda xs: f"{statistics.median(xs):.0f}"  # noqa: E731
        lines.append(f"| {ws} | {med([r['ours']['process_peak_rss_mib'] for r in rs])} | "
                     f"{statistics.median([r['ours']['ledger_peak_mib_sum'] for r in rs]):.1f} | "
                     f"{med([r['fsdp2_full']['peak_rss_mib_sum'] for r in rs])} | {med([r['fsdp2_full']['peak_minus_init_mib_sum'] for r in rs])} | "
                     f"{med([r['ds_zero3']['peak_rss_mib_sum'] for r in rs])} | {med([r['ds_zero3']['peak_minus_init_mib_sum'] for r in rs])} |")
    lines.append("")
    r0 = recs[0]
    lines.append(f"Params: ours {r0['ours']['param_count']:,}, peers {r0['fsdp2_full']['param_count']:,}; "
                 f"peer threads per rank: " + ", ".join(f"ws {r['ws']}: {r['fsdp2_full']['threads_per_rank']}" for r in recs[:len(wss)]) + ".")
    lines.append("Our command (ws 2): `" + r0["ours"]["cmd"] + "`")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank per step (both sides)")
    ap.add_argument("--micro-batch-size", type=int, default=8,
                    help="ours: sequences per micro-batch (default 8: one micro-batch per rank, like the peers)")
    ap.add_argument("--replicate-every", type=int, default=0,
                    help="ours: buddy backups every K steps (default 0: off, since FSDP2 and DeepSpeed keep none; "
                         "ezero's own default is 1)")
    ap.add_argument("--activation-checkpointing", choices=["auto", "always", "never"],
                    help="ours: recompute each block's forward (always), keep its intermediates as the peers do "
                         "(never), or ezero's default (auto: keep when they fit the memory budget, as here)")
    ap.add_argument("--keep-activations", dest="activation_checkpointing", action="store_const", const="never",
                    help="same as --activation-checkpointing never")
    ap.add_argument("--out", default="/tmp/ezero_bench/train_runs.json")
    ap.add_argument("--ezero")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--python", default=os.environ.get("PEERS_PY", "/tmp/peers/venv/bin/python"))
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", os.path.join(ROOT, "..", "shared", "peers")))
    ap.add_argument("--summarize", metavar="JSON")
    ap.add_argument("--short", metavar="JSON", help="with --summarize: an earlier run with fewer --steps, for CPU per step")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            data = json.load(f)
        print(summarize(data))
        if args.short:
            with open(args.short) as f:
                print("\n" + cpu_per_step(data, json.load(f)))
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(summarize(measure(args)))


if __name__ == "__main__":
    main()
