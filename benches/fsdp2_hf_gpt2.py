"""FSDP2 on transformers' GPT-2: the shared peer script (../shared/peers/train_fsdp.py) with its
GPT replaced by `GPT2LMHeadModel` (random init from a `GPT2Config`, dropout off, SDPA attention,
tied head), each `GPT2Block` and the root fully sharded as the script does for its own blocks.
Data, optimizer, timing and the JSON it writes are the shared script's. Shape flags as
train_fsdp.py (`--vocab 50257 --d-model 768 --heads 12 --layers 12` is GPT-2 124M);
`--positions` sets `n_positions` (1024).
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers"))
sys.path.insert(0, PEERS)

POSITIONS = 1024
if "--positions" in sys.argv:
    i = sys.argv.index("--positions")
    POSITIONS = int(sys.argv[i + 1])
    del sys.argv[i:i + 2]


class HfGpt2(nn.Module):
    def __init__(self, vocab, seq, d, h, layers):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab, n_positions=max(seq, POSITIONS), n_embd=d, n_layer=layers,
                         n_head=h, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "sdpa"
        self.model = GPT2LMHeadModel(cfg)
        # train_fsdp.build shards `model.blocks` one by one, then the root.
        self.blocks = self.model.transformer.h

    def forward(self, idx, targets):
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


import train_fsdp  # noqa: E402

train_fsdp.GPT = HfGpt2

if __name__ == "__main__":
    train_fsdp.main()
