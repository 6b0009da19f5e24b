#!/usr/bin/env python3
"""Adam step throughput: `ezero bench adam` vs PyTorch fused AdamW and DeepSpeedCPUAdam, side by side.

For every round and every cell (size x threads) it runs our benchmark and the peer script
(../shared/peers/adam_bench.py, flat fp32 layout, AdamW, impls fused + deepspeed) back to back,
alternating which goes first, while a sampler records how much CPU other processes used. It writes
the raw results as JSON and prints the Markdown tables used in BENCHMARKS.md.

    python3 benches/compare_adam.py                    # 3 rounds x 6 cells, ~10 min
    python3 benches/compare_adam.py --rounds 5 --out /tmp/adam_runs.json
    python3 benches/compare_adam.py --summarize /tmp/adam_runs.json     # tables only
    python3 benches/compare_adam.py --summarize a.json b.json           # pool the rounds of two runs

Both sides: AdamW (decoupled weight decay on), fp32, one flat buffer of N = 1e6 / 16e6 / 64e6
elements (the peer script's "1M" means 10^6), median of 5 timed repeats of >= 0.3 s each after
warm-up. Effective GB/s counts 28 B/param for both. Our JSON line also carries the STREAM-style
triad bandwidth measured in the same process (12 B/element, arrays >= 384 MiB), the roofline that
the >= 90 % target refers to; the peer call also reports torch's own add_ bandwidth (64e6-element
tensors, 12 B/element), shown next to it as a second reference.

Needs: `cargo build --release` (done by the script unless --no-build) and the peers venv
(`bash ../shared/peers/setup.sh`, /tmp/peers/venv).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in benches/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"1M": 10**6, "16M": 16 * 10**6, "64M": 64 * 10**6}


def run_ours(ezero, n, t, min_time_s):
    out = subprocess.run([ezero, "bench", "adam", "--numel", str(n), "--threads", str(t),
                          "--min-time-s", str(min_time_s)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_peers(py, peers, size, t, tmp):
    cmd = [py, os.path.join(peers, "adam_bench.py"), "--sizes", size, "--threads", str(t),
           "--impls", "fused", "deepspeed", "--layouts", "flat", "--optimizers", "adamw",
           "--json", tmp]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    with open(tmp) as f:
        doc = json.load(f)
    res = doc["results"]
    # torch's own memory-bandwidth reference from the same call (64e6-element tensors, 1 thread
    # count): copy_ (R+W, 8 B/elem) and add_ (2R+W, 12 B/elem; reads its output first, so no
    # write-allocate traffic is left uncounted).
    stream = next(iter(doc.get("stream_GBps", {}).values()), {})
    out = {"torch_copy_gb_per_s": stream.get("copy"), "torch_add_gb_per_s": stream.get("add_(b,alpha)")}
    for r in res:
        if "error" in r:
            raise RuntimeError(f"peer {r['impl']} failed: {r['error']}")
        out[r["impl"]] = {"params_per_s": r["params_per_s"], "gb_per_s": r["GBps"],
                          "best_params_per_s": r["n"] / r["step_s_min"]}
    return out


def measure(args):
    ezero = args.ezero or os.path.join(ROOT, "target", "release", "ezero")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    tmp = args.out + ".peer.tmp.json"
    records = []
    t_start = time.time()
    with benchlib.LoadSampler(1.0) as sampler:
        for rnd in range(args.rounds):
            for ci, (size, t) in enumerate((s, t) for s in args.sizes for t in args.threads):
                n = SIZES[size]
                order = ["ours", "peers"] if (rnd + ci) % 2 == 0 else ["peers", "ours"]
                rec = {"round": rnd, "size": size, "n": n, "threads": t, "order": order}
                for who in order:
                    t0 = time.monotonic()
                    if who == "ours":
                        rec["ours"] = run_ours(ezero, n, t, args.min_time_s)
                    else:
                        rec["peers"] = run_peers(args.python, args.peers, size, t, tmp)
                    rec[f"load_{who}"] = sampler.window(t0, time.monotonic())
                records.append(rec)
                o, p = rec["ours"], rec["peers"]
                print(f"round {rnd} {size:>3} thr {t}: ours {o['params_per_s']/1e6:7.0f} M/s "
                      f"(triad {o['triad_gb_per_s']:.1f} GB/s, ratio {o['ratio_to_triad']:.2f}); "
                      f"fused {p['fused']['params_per_s']/1e6:7.0f}; ds {p['deepspeed']['params_per_s']/1e6:7.0f}; "
                      f"foreign cores {rec['load_ours']['foreign_cores_mean'] or 0:.2f}/"
                      f"{rec['load_peers']['foreign_cores_mean'] or 0:.2f}", flush=True)
        overall = sampler.overall()
    if os.path.exists(tmp):
        os.remove(tmp)
    data = {"machine": benchlib.machine_description(), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
            "rounds": args.rounds, "min_time_s": args.min_time_s, "load": overall, "records": records}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return data


def merge(paths):
    """Pools the rounds of several runs into one data set (load figures: the runs' medians)."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    if len(docs) == 1:
        return docs[0]
    recs, off = [], 0
    for d in docs:
        for r in d["records"]:
            recs.append({**r, "round": r["round"] + off})
        off += d["rounds"]
    loads = [d["load"] for d in docs]
    load = {"foreign_cores_median": statistics.median(x["foreign_cores_median"] for x in loads),
            "foreign_cores_p90": max(x["foreign_cores_p90"] for x in loads),
            "load1_min": min(x["load1_min"] for x in loads), "load1_max": max(x["load1_max"] for x in loads),
            "load1_median": statistics.median(x["load1_median"] for x in loads)}
    return {"machine": docs[0]["machine"], "started": " and ".join(d["started"] for d in docs),
            "rounds": off, "min_time_s": docs[0]["min_time_s"], "load": load, "records": recs}


def summarize(data):
    recs = data["records"]
    cells = []
    for r in recs:
        key = (r["size"], r["threads"])
        if key not in cells:
            cells.append(key)
    load = data.get("load", {})
    lines = [f"Machine: {data['machine']}. Started {data['started']}, {data['rounds']} rounds "
             f"(each cell: ours and the peer script back to back, order alternating).",
             f"Load: other processes used a median {load.get('foreign_cores_median', float('nan')):.2f} "
             f"(p90 {load.get('foreign_cores_p90', float('nan')):.2f}) of the 2 cores; 1-min load average "
             f"{load.get('load1_min', float('nan')):.1f}–{load.get('load1_max', float('nan')):.1f} "
             f"(median {load.get('load1_median', float('nan')):.1f}).", ""]
    lines.append("Throughput, M params/s: median over rounds (min–max); each run is itself the median of 5 timed repeats.\n")
    lines.append("| N | thr | ours | torch fused | DeepSpeedCPUAdam | ours/DS | ours/fused | ours GB/s | triad GB/s | ours/triad | torch add_ GB/s | ours/add_ | foreign cores |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for size, t in cells:
        rs = [r for r in recs if (r["size"], r["threads"]) == (size, t)]
        ours = [r["ours"]["params_per_s"] / 1e6 for r in rs]
        fused = [r["peers"]["fused"]["params_per_s"] / 1e6 for r in rs]
        ds = [r["peers"]["deepspeed"]["params_per_s"] / 1e6 for r in rs]
        r_ds = [r["ours"]["params_per_s"] / r["peers"]["deepspeed"]["params_per_s"] for r in rs]
        r_fu = [r["ours"]["params_per_s"] / r["peers"]["fused"]["params_per_s"] for r in rs]
        gb = [r["ours"]["gb_per_s"] for r in rs]
        triad = [r["ours"]["triad_gb_per_s"] for r in rs]
        rt = [r["ours"]["ratio_to_triad"] for r in rs]
        tadd = [r["peers"].get("torch_add_gb_per_s") for r in rs if r["peers"].get("torch_add_gb_per_s")]
        r_add = [r["ours"]["gb_per_s"] / r["peers"]["torch_add_gb_per_s"] for r in rs if r["peers"].get("torch_add_gb_per_s")]
        fc = [x for r in rs for x in (r["load_ours"].get("foreign_cores_mean"), r["load_peers"].get("foreign_cores_mean")) if x is not None]
        lines.append(f"| {size} | {t} | {benchlib.med_range(ours)} | {benchlib.med_range(fused)} | {benchlib.med_range(ds)} | "
                     f"{benchlib.med_range(r_ds, '{:.2f}')} | {benchlib.med_range(r_fu, '{:.2f}')} | "
                     f"{benchlib.med_range(gb, '{:.1f}')} | {benchlib.med_range(triad, '{:.1f}')} | "
                     f"{benchlib.med_range(rt, '{:.2f}')} | {benchlib.med_range(tadd, '{:.1f}')} | "
                     f"{benchlib.med_range(r_add, '{:.2f}')} | {benchlib.med_range(fc, '{:.2f}')} |")
        verdicts.append((size, t, statistics.median(r_ds), statistics.median(rt)))
    lines.append("")
    lines.append("Targets (issue 2): ours ≥ DeepSpeedCPUAdam in every cell; ours ≥ 0.90 × the same run's triad.\n")
    lines.append("| N | thr | ours/DS (median) | ≥ DS? | ours/triad (median) | ≥ 0.90? |")
    lines.append("|---|---:|---:|---|---:|---|")
    for size, t, rds, rt in verdicts:
        lines.append(f"| {size} | {t} | {rds:.2f} | {'met' if rds >= 1 else f'not met ({(1 - rds) * 100:.0f}% short)'} | "
                     f"{rt:.2f} | {'met' if rt >= 0.9 else f'not met ({(0.9 - rt) / 0.9 * 100:.0f}% short)'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"], choices=list(SIZES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--min-time-s", type=float, default=1.5, help="ours: total timed seconds (5 repeats)")
    ap.add_argument("--out", default="/tmp/ezero_bench/adam_runs.json")
    ap.add_argument("--ezero", help="path of the ezero binary (default: target/release/ezero)")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--python", default=os.environ.get("PEERS_PY", "/tmp/peers/venv/bin/python"))
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", os.path.join(ROOT, "..", "shared", "peers")))
    ap.add_argument("--summarize", metavar="JSON", nargs="+",
                    help="only print the tables of earlier runs (several files are pooled: all their rounds count)")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(merge(args.summarize)))
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(summarize(measure(args)))


if __name__ == "__main__":
    main()
