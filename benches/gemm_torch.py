"""PyTorch's single-thread GEMM, driven by `ezero bench gemm --torch-python PY`.

`ezero` runs this file (passed in the environment) with `PY -c ... <repeat_s>` and keeps the
process: it writes one shape per line on stdin as JSON ({"name", "m", "k", "n", "form"}),
right before or after timing the same shape itself, and reads back one JSON line {"shape",
"gflops"}. Pairing each shape this way keeps the two measurements seconds apart on a machine
whose speed drifts.

With a second argument `bf16`, the operands and the output are bf16 (what a bf16 autocast or an
FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)` forward multiplies); otherwise f32.

Each product writes into a preallocated output (`out=`), as ours does, and is timed like ours:
one warm-up call, then the median of 5 repeats, each calling the product back to back for at
least repeat_s seconds.
"""
import json
import sys
import time

import torch

torch.set_num_threads(1)
repeat_s = float(sys.argv[1])
dtype = torch.bfloat16 if sys.argv[2:] == ["bf16"] else torch.float32
ops = {}

for line in sys.stdin:
    s = json.loads(line)
    m, k, n, form = s["m"], s["k"], s["n"], s["form"]
    key = (m, k, n, form)
    if key not in ops:
        g = torch.Generator().manual_seed(0)
        if form == "nn":
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        elif form == "nt":
            a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
        elif form == "tn":
            a, b = torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)
        else:
            sys.exit(f"unknown form {form!r}")
        ops[key] = (a.to(dtype), b.to(dtype), torch.empty(m, n, dtype=dtype))
    a, b, c = ops[key]
    torch.mm(a, b, out=c)
    per_call = []
    for _ in range(5):
        calls, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=c)
            calls += 1
            dt = time.perf_counter() - t0
            if dt >= repeat_s:
                break
        per_call.append(dt / calls)
    per_call.sort()
    print(json.dumps({"shape": s["name"], "gflops": 2.0 * m * k * n / per_call[2] / 1e9}), flush=True)
