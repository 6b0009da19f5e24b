#!/usr/bin/env python3
"""CPU cost per byte of gloo's collectives (torch.distributed over loopback TCP), the peer that
`benches/collectives.sh` compares QUIC with.

The peers' own script (../shared/peers/collectives.py) reports time only. This one times the
same ops the same way (float32, nccl-tests sizes, mean of a back-to-back loop, max over ranks)
and also sums, over ranks, the CPU seconds each rank process used during the loop (every thread:
gloo's I/O threads included, from getrusage). From those:

  cpu_util     = CPU seconds of all ranks / wall seconds (2.0 is both cores of this machine)
  moved_bytes  = payload bytes delivered per op, all ranks together:
                 (n-1)*S for all_gather, reduce_scatter and broadcast, 2(n-1)*S for all_reduce
  cpu_s_per_gb = CPU seconds per 1e9 bytes delivered

`benches/cpu_bound.py` turns these into the best busbw any transport could reach on this machine
if it spent gloo's CPU per byte plus an AEAD seal and open per byte.

Usage: PY benches/gloo_cpu.py [--world-sizes 2 4] [--sizes-mib 16 64] [--ops ...] [--json F]
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast"]
BUS = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
       "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
MOVED = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_reduce": lambda n: 2 * (n - 1), "broadcast": lambda n: n - 1}


def op_fn(name, n, rank, numel):
    if name == "all_gather":
        inp, out = torch.full((numel // n,), float(rank + 1)), torch.empty(numel)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if name == "reduce_scatter":
        inp, out = torch.full((numel,), float(rank + 1)), torch.empty(numel // n)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    t = torch.full((numel,), float(rank + 1))
    if name == "all_reduce":
        return lambda: dist.all_reduce(t)
    return lambda: dist.broadcast(t, 0)


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def reduce(x, op):
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def worker(rank, n, store, args, out_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    rows = []
    for op in args.ops:
        for mib in args.sizes_mib:
            numel = int(mib * (1 << 20)) // 4
            numel -= numel % n
            size = numel * 4
            fn = op_fn(op, n, rank, numel)
            fn()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            once = reduce(time.perf_counter() - t0, dist.ReduceOp.MAX)
            iters = max(3, min(50, math.ceil(args.min_time / max(once, 1e-6))))
            reps = []
            for _ in range(args.repeats):
                dist.barrier()
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(iters):
                    fn()
                wall, cpu = time.perf_counter() - t0, cpu_s() - c0
                reps.append((reduce(wall, dist.ReduceOp.MAX), reduce(cpu, dist.ReduceOp.SUM)))
            wall, cpu = sorted(reps)[len(reps) // 2]
            t = wall / iters
            moved = MOVED[op](n) * size * iters
            rows.append({"transport": "gloo", "op": op, "nprocs": n, "bytes": size,
                         "time_s": t, "algbw_gbps": size / t / 1e9,
                         "busbw_gbps": size / t / 1e9 * BUS[op](n),
                         "cpu_util": cpu / wall, "cpu_s_per_gb": cpu / (moved / 1e9)})
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64])
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per timed loop")
    p.add_argument("--json", help="also append the JSON lines here")
    args = p.parse_args()
    for n in args.world_sizes:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            mp.spawn(worker, args=(n, os.path.join(d, "store"), args, out), nprocs=n)
            with open(out) as f:
                rows = json.load(f)
        for r in rows:
            line = json.dumps(r)
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
