"""Reads files written by `ezero checkpoint export` with the Python `safetensors` package, an
independent reader, and checks them against what the Rust test expects.

Usage: checkpoint_safetensors.py EXPECT.json

EXPECT.json: {"fp32": PATH, "bf16": PATH, "optimizer": PATH, "param_sha256": HEX,
              "params": [[NAME, SHAPE], ...], "state": ["exp_avg", ...]}

Exits 2, saying so, when the package is not installed: the Rust test that runs it is ignored
unless asked for (`cargo test -- --include-ignored`, which `.ci/run` runs with a Python that has it).
"""

import hashlib
import json
import struct
import sys

try:
    from safetensors import deserialize
except ImportError:
    print("this check needs the Python safetensors package (pip install safetensors)")
    sys.exit(2)


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
    return dict(deserialize(data)), meta


def main():
    with open(sys.argv[1]) as f:
        want = json.load(f)
    names = [name for name, _ in want["params"]]

    fp32, meta = load(want["fp32"])
    assert sorted(fp32) == sorted(names), (sorted(fp32), sorted(names))
    digest = hashlib.sha256()
    for name, shape in want["params"]:
        t = fp32[name]
        assert t["dtype"] == "F32", (name, t["dtype"])
        assert list(t["shape"]) == shape, (name, t["shape"], shape)
        digest.update(bytes(t["data"]))
    # Tensors in model order, little-endian fp32: exactly what `ezero train` digests.
    assert digest.hexdigest() == want["param_sha256"], digest.hexdigest()
    assert meta.get("fp32_param_sha256") == want["param_sha256"], meta

    bf16, meta = load(want["bf16"])
    assert meta.get("dtype") == "bf16", meta
    for name, shape in want["params"]:
        t = bf16[name]
        assert t["dtype"] == "BF16" and list(t["shape"]) == shape, (name, t["dtype"])
        full = bytes(fp32[name]["data"])
        half = bytes(t["data"])
        assert len(half) * 2 == len(full)
        # The top 16 bits of each fp32, rounded: never more than one bf16 step away.
        for k in range(0, len(half), 2):
            hi = struct.unpack_from("<H", full, 2 * k + 2)[0]
            got = struct.unpack_from("<H", half, k)[0]
            assert got in (hi, (hi + 1) & 0xFFFF), (name, k, hi, got)

    opt, _ = load(want["optimizer"])
    expected = sorted(f"{name}.{s}" for name in names for s in want["state"])
    assert sorted(opt) == expected, sorted(opt)
    print(f"ok: {len(fp32)} tensors, {len(opt)} optimizer tensors read by safetensors")


if __name__ == "__main__":
    main()
