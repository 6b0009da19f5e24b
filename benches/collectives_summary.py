#!/usr/bin/env python3
"""Summary of benches/collectives.sh output: median busbw per (op, ranks, size) for QUIC, gloo
and in-process, the QUIC/gloo ratio, iperf3's loopback TCP rate and the tuning table."""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ezero_bench/collectives"


def lines(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return []
    return [json.loads(l) for l in open(p) if l.startswith("{")]


def med(v):
    return statistics.median(v) if v else float("nan")


ours = defaultdict(list)
cpu = defaultdict(list)
for r in lines("quic.jsonl"):
    ours[("quic", r["op"], r["nprocs"], r["bytes"])].append(r["busbw_gbps"])
    cpu[(r["op"], r["nprocs"], r["bytes"])].append(r["cpu_util"])
for r in lines("local.jsonl"):
    ours[("local", r["op"], r["nprocs"], r["bytes"])].append(r["busbw_gbps"])
gloo = defaultdict(list)
for p in glob.glob(os.path.join(out, "gloo-*.json")):
    for r in json.load(open(p))["results"]:
        if "busbw_GBps" in r:
            gloo[(r["op"], r["world_size"], int(r["size_bytes"]) if "size_bytes" in r else int(r["size_mib"] * 2**20))].append(r["busbw_GBps"])

print(f"{'op':<15}{'n':>3}{'MiB':>6}{'quic':>9}{'gloo':>9}{'quic/gloo':>10}{'local':>9}{'quic cpu':>9}  (busbw GB/s, medians)")
for key in sorted(k for k in ours if k[0] == "quic"):
    _, op, n, b = key
    q, g, l = med(ours[key]), med(gloo.get((op, n, b), [])), med(ours.get(("local", op, n, b), []))
    print(f"{op:<15}{n:>3}{b / 2**20:>6.0f}{q:>9.3f}{g:>9.3f}{q / g if g == g else float('nan'):>10.2f}{l:>9.3f}{med(cpu[(op, n, b)]):>9.2f}")

for p in sorted(glob.glob(os.path.join(out, "iperf-*.json"))):
    try:
        e = json.load(open(p))["end"]
        print(f"iperf3 loopback TCP, 1 stream: {e['sum_received']['bits_per_second'] / 8e9:.3f} GB/s ({os.path.basename(p)})")
    except (KeyError, ValueError):
        pass
for r in lines("aead.jsonl"):
    alg = {"aead_aes128gcm": "AES-128-GCM", "aead_aes256gcm": "AES-256-GCM"}.get(r["op"], r["op"])
    print(f"{alg} one core, {r['packet_bytes']} B packets: seal {r['seal_gbps']:.2f} GB/s, open {r['open_gbps']:.2f} GB/s")
tun = defaultdict(list)
for r in lines("tuning.jsonl"):
    tun[(r["variant"], r["op"])].append(r["busbw_gbps"])
if tun:
    print(f"\n{'variant (2 procs, 64 MiB)':<52}{'op':<12}{'busbw runs':>24}")
    for (v, op), xs in tun.items():
        print(f"{v:<52}{op:<12}{', '.join(f'{x:.3f}' for x in xs):>24}")
