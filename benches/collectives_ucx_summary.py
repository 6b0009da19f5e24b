#!/usr/bin/env python3
"""Summary of benches/collectives_ucx.sh: median busbw per (op, ranks, size) over UCX and gloo
with their ratio (target >= 2), and UCX broadcast between 2 processes (one message from the
root to its peer: point to point) against ucx_perftest tag_bw (target >= 0.8)."""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ezero_bench/collectives_ucx"


def med(v):
    return statistics.median(v) if v else float("nan")


ucx = defaultdict(list)
cpu = defaultdict(list)
for line in open(os.path.join(out, "ucx.jsonl")):
    if line.startswith("{"):
        r = json.loads(line)
        ucx[(r["op"], r["nprocs"], r["bytes"])].append(r["busbw_gbps"])
        cpu[(r["op"], r["nprocs"], r["bytes"])].append(r["cpu_util"])
gloo = defaultdict(list)
for p in glob.glob(os.path.join(out, "gloo-*.json")):
    for r in json.load(open(p))["results"]:
        if "busbw_GBps" in r:
            size = int(r["size_bytes"]) if "size_bytes" in r else int(r["size_mib"] * 2**20)
            gloo[(r["op"], r["world_size"], size)].append(r["busbw_GBps"])

met = 0
print(f"{'op':<15}{'n':>3}{'MiB':>6}{'ucx':>9}{'gloo':>9}{'ucx/gloo':>10}{'ucx cpu':>9}  (busbw GB/s, medians; runs: ucx {{}})")
for key in sorted(ucx):
    op, n, b = key
    u, g = med(ucx[key]), med(gloo.get(key, []))
    ratio = u / g if g == g and g > 0 else float("nan")
    met += ratio >= 2
    print(f"{op:<15}{n:>3}{b / 2**20:>6.0f}{u:>9.3f}{g:>9.3f}{ratio:>10.2f}{med(cpu[key]):>9.2f}  {['%.3f' % x for x in ucx[key]]}")
print(f"busbw >= 2x gloo in {met} of {len(ucx)} cells")

perf = defaultdict(list)
for p in glob.glob(os.path.join(out, "perftest-*.txt")):
    mib = int(re.search(r"perftest-(\d+)-", p).group(1))
    for line in open(p):
        if line.startswith("Final:"):
            # Columns: iterations, overhead 50%/avg/overall (us), bandwidth avg/overall (MB/s:
            # ucx_perftest's MB is 2^20 bytes), message rate avg/overall.
            perf[mib].append(float(line.split()[6]) * 2**20 / 1e9)
for mib in sorted(perf):
    p = med(perf[mib])
    u = med(ucx.get(("broadcast", 2, mib << 20), []))
    print(f"point to point, {mib} MiB: ucx_perftest tag_bw {p:.3f} GB/s {['%.3f' % x for x in perf[mib]]}, "
          f"ours (broadcast, 2 processes) {u:.3f} GB/s = {u / p:.2f}x")
