"""FSDP2 with bf16 mixed precision: the shared peer script (../shared/peers/train_fsdp.py) with
every `fully_shard` call given `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`.

The shared script is used as is, so the model, data, optimizer and timing are the fp32 peer's;
only the policy differs. Same arguments as train_fsdp.py (use `--modes fsdp2_full`). The patch is
made at import, so the worker processes `torch.multiprocessing.spawn` starts (which import this
file as their main module) get it too.
"""
import os
import sys

import torch
import torch.distributed.fsdp as fsdp

PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers"))
sys.path.insert(0, PEERS)

_fully_shard = fsdp.fully_shard
POLICY = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fully_shard_bf16(module, **kwargs):
    kwargs.setdefault("mp_policy", POLICY)
    return _fully_shard(module, **kwargs)


fsdp.fully_shard = fully_shard_bf16

import train_fsdp  # noqa: E402

if __name__ == "__main__":
    train_fsdp.main()
