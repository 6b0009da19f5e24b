"""Shared helpers for the comparison scripts in benches/ (plain python3, no third-party modules).

LoadSampler measures how busy the machine was *besides us*: every `interval` seconds it reads the
machine's busy CPU time (/proc/stat) and the CPU time of this process tree (this script and every
live descendant, including time of children they already reaped), and records
    foreign_cores = (busy_delta - ours_delta) / interval
i.e. how many of the cores other processes (other people's cargo builds, ...) were using. It also
records the 1-minute load average. `window(t0, t1)` summarises the samples taken during a run.
"""
import os
import statistics
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def _busy_ticks():
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # user nice system idle iowait irq softirq steal
    return total - idle


def _proc_table():
    """pid -> (ppid, utime+stime+cutime+cstime ticks)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rindex(")") + 2:].split()
        # fields after comm: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
        out[int(name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))
    return out


def _our_ticks(root):
    table = _proc_table()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
        stack.extend(children.get(pid, []))
    return total


class LoadSampler:
    def __init__(self, interval=1.0):
        self.interval = interval
        self.samples = []  # (t, foreign_cores, load1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.root = os.getpid()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        t_prev, busy_prev, ours_prev = time.monotonic(), _busy_ticks(), _our_ticks(self.root)
        while not self._stop.wait(self.interval):
            t, busy, ours = time.monotonic(), _busy_ticks(), _our_ticks(self.root)
            dt = t - t_prev
            foreign = max(0.0, ((busy - busy_prev) - (ours - ours_prev)) / TICK / dt)
            self.samples.append((t, foreign, os.getloadavg()[0]))
            t_prev, busy_prev, ours_prev = t, busy, ours

    def window(self, t0, t1):
        xs = [s for s in self.samples if t0 <= s[0] <= t1 + self.interval]
        if not xs:
            return {"foreign_cores_mean": None, "load1_mean": os.getloadavg()[0], "samples": 0}
        return {
            "foreign_cores_mean": statistics.fmean(s[1] for s in xs),
            "foreign_cores_max": max(s[1] for s in xs),
            "load1_mean": statistics.fmean(s[2] for s in xs),
            "samples": len(xs),
        }

    def overall(self):
        if not self.samples:
            return {}
        f = [s[1] for s in self.samples]
        l1 = [s[2] for s in self.samples]
        return {
            "foreign_cores_median": statistics.median(f),
            "foreign_cores_mean": statistics.fmean(f),
            "foreign_cores_p90": sorted(f)[int(0.9 * (len(f) - 1))],
            "load1_median": statistics.median(l1),
            "load1_min": min(l1),
            "load1_max": max(l1),
            "seconds": self.samples[-1][0] - self.samples[0][0] + self.interval,
        }


def med_range(xs, fmt="{:.0f}"):
    """'median (min–max)' of a list; just the value when there is one."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def machine_description():
    model, flags = "?", ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "SSE")
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return f"{os.cpu_count()} vCPU {model} ({isa}), {mem_kib / 2**20:.0f} GiB"
