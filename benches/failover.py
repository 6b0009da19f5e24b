#!/usr/bin/env python3
"""Coordinator failover, measured on this machine with a real local etcd (`--meta etcd-local`).

Two targets (issue: the coordinator may die too):
  failover time  kill -9 of the leading coordinator -> the next completed step, at the default
                 lease and heartbeats; median over rounds (target: under 10 s). Also split into
                 kill -> election and election -> next step.
  steady state   median step time of a job kept in etcd (two coordinators) over the same job
                 with one coordinator and no store, alternated in one run over several rounds
                 (target: at most 1.02x).

Usage: python3 benches/failover.py [--rounds N] [--ezero target/release/ezero]
Needs etcd on PATH (apt-get install etcd-server). Prints one line per round and a summary.
"""
import argparse
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import machine_description  # noqa: E402

# The job of the report: a small GPT on three worker processes.
TRAIN = ["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq-len",
         "32", "--micro-batches", "6"]
# The steady state's job: steps of about 70 ms here, so that the median's millisecond
# resolution is about 1.5% of it.
STEADY = ["--model", "gpt", "--layers", "2", "--d-model", "128", "--heads", "4", "--seq-len",
          "64", "--micro-batches", "6"]


def spawn(cmd):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines = queue.Queue()

    def pump():
        for line in p.stdout:
            lines.put((time.monotonic(), line.rstrip("\n")))
        lines.put((time.monotonic(), None))

    threading.Thread(target=pump, daemon=True).start()
    return p, lines


def wait_for(lines, pattern, timeout, log):
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no line matching {pattern!r} within {timeout} s:\n" + "\n".join(log[-30:]))
        try:
            t, line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"the launch ended before {pattern!r}:\n" + "\n".join(log[-30:]))
        log.append(line)
        if re.search(pattern, line):
            return t, line


def stop(p):
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def failover_round(ezero, job):
    cmd = [ezero, "launch", "--nprocs", "3", "--coordinators", "2", "--meta", "etcd-local",
           "--job-id", job, "--"] + TRAIN + ["--steps", "1000000"]
    p, lines = spawn(cmd)
    log = []
    try:
        _, line = wait_for(lines, r"leads the job from term", 120, log)
        leader = int(re.search(r"\(pid (\d+)\)", line).group(1))
        wait_for(lines, r"^step ", 120, log)
        time.sleep(3)  # training under way: the kill lands mid-step
        t_kill = time.monotonic()
        os.kill(leader, signal.SIGKILL)
        t_elected, _ = wait_for(lines, r"leads the job from term", 120, log)
        wait_for(lines, r"taken over by a new coordinator", 120, log)
        t_step, _ = wait_for(lines, r"^step ", 120, log)
        return t_elected - t_kill, t_step - t_elected, t_step - t_kill
    finally:
        stop(p)


def median_step(ezero, coordinators, job, steps, replicate_every):
    cmd = [ezero, "launch", "--nprocs", "3"]
    if coordinators > 1:
        cmd += ["--coordinators", str(coordinators), "--meta", "etcd-local", "--job-id", job]
    cmd += ["--"] + STEADY + ["--steps", str(steps), "--replicate-every", str(replicate_every)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(r"median step ([0-9.]+) s", out.stdout)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each measurement [5]")
    ap.add_argument("--steps", type=int, default=150, help="steps of each steady-state run [150]")
    ap.add_argument("--ezero", default="target/release/ezero", help="the binary [target/release/ezero]")
    a = ap.parse_args()
    print(machine_description())
    fo = []
    for r in range(a.rounds):
        e, s, total = failover_round(a.ezero, f"bench-failover-{os.getpid()}-{r}")
        fo.append((e, s, total))
        print(f"failover round {r}: kill->election {e:.2f} s, election->next step {s:.2f} s, total {total:.2f} s", flush=True)
    # Buddy backups every step (the default: every step is a commit) and every 10th.
    ratios = {1: [], 10: []}
    for r in range(a.rounds):
        for every, rs in ratios.items():
            mem = median_step(a.ezero, 1, "", a.steps, every)
            etcd = median_step(a.ezero, 2, f"bench-steady-{os.getpid()}-{r}-{every}", a.steps, every)
            rs.append(etcd / mem)
            print(f"steady round {r}, backups every {every}: in memory {mem * 1e3:.1f} ms, "
                  f"etcd {etcd * 1e3:.1f} ms, ratio {etcd / mem:.3f}", flush=True)
    totals = sorted(t for _, _, t in fo)
    print(f"failover: median {statistics.median(totals):.2f} s (range {totals[0]:.2f}-{totals[-1]:.2f}), "
          f"kill->election median {statistics.median(e for e, _, _ in fo):.2f} s, "
          f"election->next step median {statistics.median(s for _, s, _ in fo):.2f} s over {a.rounds} rounds")
    for every, rs in ratios.items():
        print(f"steady state, backups every {every}: etcd / in memory median ratio "
              f"{statistics.median(rs):.3f} (range {min(rs):.3f}-{max(rs):.3f}) over {a.rounds} rounds")

if __name__ == "__main__":
    main()
