#!/usr/bin/env python3
"""Summary of benches/collectives.sh output: median busbw per (op, ranks, size) for QUIC, gloo
and in-process, the QUIC/gloo ratio, iperf3's loopback TCP rate, the tuning table, and the CPU
per byte of QUIC and gloo with the ceiling that encryption puts on any transport here."""
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

iperf_cost = []
for p in sorted(glob.glob(os.path.join(out, "iperf-*.json"))):
    try:
        e = json.load(open(p))["end"]
        rate = e["sum_received"]["bits_per_second"] / 8e9
        cpu = (e["cpu_utilization_percent"]["host_total"] + e["cpu_utilization_percent"]["remote_total"]) / 100
        iperf_cost.append(cpu / rate)
        print(f"iperf3 loopback TCP, 1 stream: {rate:.3f} GB/s on {cpu:.2f} cores, "
              f"{cpu / rate:.3f} CPU-s/GB ({os.path.basename(p)})")
    except (KeyError, ValueError, ZeroDivisionError):
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

# CPU per byte, and the ceiling encryption sets. Mutual TLS means every byte is sealed once and
# opened once. The cheapest way a byte was seen to move through the kernel (C_k: the lowest CPU-s
# per delivered GB of any gloo op at that rank count and size, in any run of
# benches/gloo_cpu.py, or of any iperf3 run) is taken as the cost of moving it at all; add one
# AEAD seal and open at the best rates measured (C_a, from --aead, one core) and let that
# transport use every core. Its busbw is then at most
#   cores / (C_k + C_a) bytes per second delivered, expressed in the op's busbw.
# Every input is the most favourable one measured, so the ceiling errs high. "ceil/gloo" below 1:
# even a transport as lean as the cheapest transfer seen plus encryption, and nothing else,
# would not reach gloo's median in that cell on this machine. "quic/ceil" is how close we are.
gcpu = defaultdict(list)
for r in lines("gloo_cpu.jsonl"):
    gcpu[(r["op"], r["nprocs"], r["bytes"])].append(r)
aes = [r for r in lines("aead.jsonl") if r["op"] == "aead_aes256gcm"]
if gcpu and aes:
    cores = os.cpu_count()
    c_a = min(1 / r["seal_gbps"] + 1 / r["open_gbps"] for r in aes)
    moved = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
             "all_reduce": lambda n: 2 * (n - 1), "broadcast": lambda n: n - 1}
    bus = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
    print(f"\nCPU-s per GB delivered (medians; C_k and C_a the lowest seen); AES-256-GCM seal+open "
          f"{c_a:.3f} CPU-s/GB; {cores} cores")
    print(f"{'op':<15}{'n':>3}{'MiB':>6}{'gloo bus':>9}{'gloo cpu':>9}{'gloo s/GB':>10}{'C_k':>7}"
          f"{'quic s/GB':>10}{'ceiling':>9}{'ceil/gloo':>10}{'quic/ceil':>10}")
    for (op, n, b), rs in sorted(gcpu.items()):
        c_k = min([r["cpu_s_per_gb"] for (o, m, s), xs in gcpu.items() if (m, s) == (n, b)
                   for r in xs] + iperf_cost)
        g_bus = med([r["busbw_gbps"] for r in rs])
        ceiling = cores / (c_k + c_a) / moved[op](n) * bus[op](n)
        q = [r for r in lines("quic.jsonl") if (r["op"], r["nprocs"], r["bytes"]) == (op, n, b)]
        q_cost = med([r["cpu_util"] / (r["algbw_gbps"] * moved[op](n)) for r in q])
        q_bus = med([r["busbw_gbps"] for r in q])
        print(f"{op:<15}{n:>3}{b / 2**20:>6.0f}{g_bus:>9.3f}{med([r['cpu_util'] for r in rs]):>9.2f}"
              f"{med([r['cpu_s_per_gb'] for r in rs]):>10.3f}{c_k:>7.3f}{q_cost:>10.3f}"
              f"{ceiling:>9.3f}{ceiling / g_bus:>10.2f}{q_bus / ceiling:>10.2f}")
