"""FSDP2 on transformers' Llama: the shared peer script (../shared/peers/train_fsdp.py) with its
GPT replaced by `LlamaForCausalLM` (random init from a `LlamaConfig`, SDPA attention), each
decoder layer and the root fully sharded as the script does for its own blocks (the tied
embedding and head both sit in the root group, the one placement FSDP2 accepts for them).
Data, optimizer, timing and the JSON it writes are the shared script's.

Shape flags as train_fsdp.py (`--vocab 49152 --d-model 576 --heads 9 --layers 30`), plus
`--kv-heads`, `--ffn`, `--rope-theta`, `--positions` and `--untied`; the defaults of those are
SmolLM2-135M's (3, 1536, 1e5, 8192, tied).
"""
import os
import sys

import torch.nn as nn
import torch.nn.functional as F

PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers"))
sys.path.insert(0, PEERS)


def take(flag, default, conv):
    if flag in sys.argv:
        i = sys.argv.index(flag)
        v = conv(sys.argv[i + 1])
        del sys.argv[i:i + 2]
        return v
    return default


KV_HEADS = take("--kv-heads", 3, int)
FFN = take("--ffn", 1536, int)
THETA = take("--rope-theta", 100000.0, float)
POSITIONS = take("--positions", 8192, int)
TIED = "--untied" not in sys.argv
if not TIED:
    sys.argv.remove("--untied")


class HfLlama(nn.Module):
    def __init__(self, vocab, seq, d, h, layers):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=FFN, num_hidden_layers=layers,
                          num_attention_heads=h, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                          max_position_embeddings=max(seq, POSITIONS),
                          rope_parameters={"rope_type": "default", "rope_theta": THETA},
                          tie_word_embeddings=TIED)
        cfg._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(cfg)
        # train_fsdp.build shards `model.blocks` one by one, then the root.
        self.blocks = self.model.model.layers

    def forward(self, idx, targets):
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


import train_fsdp  # noqa: E402

train_fsdp.GPT = HfLlama

if __name__ == "__main__":
    train_fsdp.main()
