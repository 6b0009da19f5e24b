#!/usr/bin/env python3
"""Fine-tuning a Hugging Face model, side by side: `ezero train --init hf:DIR` with ZeRO-3
against transformers' model under FSDP2 (benches/fsdp2_hf_gpt2.py, benches/fsdp2_hf_llama.py),
same shape and global batch (seq 256, 8 sequences per step), runs alternating, never two at
once. `--model gpt2` is GPT-2 124M, `--model smollm2` SmolLM2-135M (Llama: 30 layers of 576,
9 heads over 3 kv heads, tied 49152-token embedding).

DIR is a random-init model of that shape that transformers saves here (no download; the
--python environment needs torch and transformers: `pip install transformers` in the peers'
venv). Both
train on byte-level data (ids below 256): the step's cost does not depend on which ids they
are.

    python3 benches/compare_hf.py --model smollm2 --rounds 2 --world-sizes 2

Prints a markdown table (median over rounds of each run's median step, min–max) and writes the
records to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import compare_train as ct  # noqa: E402

ROOT = os.path.dirname(HERE)
SEQ, GLOBAL = 256, 8
# Ours with its defaults (in one process: no buddy backups, activations recomputed when keeping
# them would add more than a quarter to the memory), ours keeping every block's activations
# (faster, more memory), and the peer.
WHO = ["ours", "ours_keep", "fsdp2"]
EXTRA = {
    "ours": [],
    "ours_keep": ["--activation-checkpointing", "never"],
}


# Per model: the transformers class and config that make DIR, the peer script, its shape flags.
MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config()", "fsdp2_hf_gpt2.py",
             ["--vocab", "50257", "--d-model", "768", "--heads", "12", "--layers", "12"]),
    "smollm2": ("LlamaForCausalLM",
                "LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, "
                "num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, "
                "rope_parameters={'rope_type': 'default', 'rope_theta': 100000.0}, tie_word_embeddings=True)",
                "fsdp2_hf_llama.py",
                ["--vocab", "49152", "--d-model", "576", "--heads", "9", "--layers", "30"]),
}


def make_model(py, model, out):
    if os.path.exists(os.path.join(out, "config.json")):
        return
    cls, cfg, _, _ = MODELS[model]
    code = (
        f"import torch; from transformers import {cls}, {cfg.split('(')[0]}; torch.manual_seed(0); "
        f"{cls}({cfg}).save_pretrained({out!r})"
    )
    subprocess.run([py, "-c", code], check=True)


def run_ours(ezero, model_dir, ws, steps, tmpdir, extra=()):
    out = os.path.join(tmpdir, f"ours-ws{ws}.json")
    cmd = ["/usr/bin/time", "-v", ezero, "train", "--init", f"hf:{model_dir}", "--seq-len", str(SEQ),
           "--ranks", str(ws), "--micro-batches", str(ws), "--micro-batch-size", str(GLOBAL // ws),
           "--steps", str(steps), "--sample-tokens", "0", "--json", out, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ours failed: {p.stderr[-2000:]}")
    with open(out) as f:
        s = json.load(f)
    return {"param_count": s["param_count"], "step_s": s["step_time_median_s"],
            "tokens_per_s": s["tokens_per_s"], "peak_rss_mib_sum": s["peak_rss_bytes"] / 2**20,
            "peak_rss_training_mib": s.get("peak_rss_training_bytes", 0) / 2**20,
            "planned_mib": s.get("planned_memory_bytes", 0) / 2**20,
            "cpu_s": ct.cpu_seconds(p.stderr), "final_loss": s["final_loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--python", default="/tmp/peers/venv/bin/python")
    ap.add_argument("--peers", default=os.path.join(ROOT, "..", "shared", "peers"))
    ap.add_argument("--out", help="[default: /tmp/ezero_bench/compare_hf_MODEL.json]")
    ap.add_argument("--ezero")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    ezero = args.ezero or os.path.join(ROOT, "target", "release", "ezero")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    args.out = args.out or f"/tmp/ezero_bench/compare_hf_{args.model}.json"
    tmpdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(tmpdir, exist_ok=True)
    model_dir = os.path.join(tmpdir, {"gpt2": "gpt2-124m", "smollm2": "smollm2-135m"}[args.model])
    make_model(args.python, args.model, model_dir)
    _, _, peer_script, shape = MODELS[args.model]
    shape = shape + ["--seq", str(SEQ)]
    records = []
    with benchlib.LoadSampler(1.0) as sampler:
        for rnd in range(args.rounds):
            for ws in args.world_sizes:
                k = rnd % len(WHO)
                order = WHO[k:] + WHO[:k]
                rec = {"round": rnd, "ws": ws, "order": order}
                for who in order:
                    t0 = time.monotonic()
                    if who in EXTRA:
                        rec[who] = run_ours(ezero, model_dir, ws, args.steps, tmpdir, EXTRA[who])
                    else:
                        script = os.path.join(HERE, peer_script)
                        rec[who] = run_peer(args, ws, tmpdir, script, shape)
                    rec[who]["load"] = sampler.window(t0, time.monotonic())
                    print(json.dumps({"round": rnd, "ws": ws, who: rec[who]}), flush=True)
                records.append(rec)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print("\n| ws | run | step s | / FSDP2 (min–max) | peak RSS MiB | / FSDP2 | planned MiB / training peak |")
    print("|---|---|---|---|---|---|---|")
    for ws in args.world_sizes:
        rs = [r for r in records if r["ws"] == ws]
        for who in WHO:
            ratio = [r[who]["step_s"] / r["fsdp2"]["step_s"] for r in rs]
            mem = [r[who]["peak_rss_mib_sum"] / r["fsdp2"]["peak_rss_mib_sum"] for r in rs]
            step = statistics.median(r[who]["step_s"] for r in rs)
            rss = statistics.median(r[who]["peak_rss_mib_sum"] for r in rs)
            plan = "—"
            if who in EXTRA and rs[0][who].get("peak_rss_training_mib"):
                p = statistics.median(r[who]["planned_mib"] / r[who]["peak_rss_training_mib"] for r in rs)
                plan = f"{rs[0][who]['planned_mib']:.0f} / {rs[0][who]['peak_rss_training_mib']:.0f} = {p:.2f}"
            print(f"| {ws} | {who} | {step:.2f} | {statistics.median(ratio):.2f} "
                  f"({min(ratio):.2f}–{max(ratio):.2f}) | {rss:.0f} | {statistics.median(mem):.2f} | {plan} |")


def run_peer(args, ws, tmpdir, script, shape):
    out = os.path.join(tmpdir, f"peer-hf-{os.path.basename(script)}-ws{ws}.json")
    cmd = ["/usr/bin/time", "-v", args.python, script, "--modes", "fsdp2_full", "--world-sizes", str(ws),
           "--steps", str(args.steps), "--warmup", "2", "--batch-per-rank", str(GLOBAL // ws),
           "--json", out] + shape
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fsdp2 failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(out) as f:
        r = json.load(f)["runs"][0]
    if "error" in r:
        raise RuntimeError(f"fsdp2 ws {ws}: {r['error']}")
    return {"param_count": r["params"], "step_s": r["step_s_median"], "tokens_per_s": r["tokens_per_s"],
            "peak_rss_mib_sum": sum(r["peak_rss_mib_per_rank"]), "cpu_s": ct.cpu_seconds(p.stderr),
            "final_loss": r["final_loss"]}


if __name__ == "__main__":
    main()
