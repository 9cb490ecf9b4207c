"""The tiny GPT of parallel_gpt.py with a fused QKV projection whose state-dict hooks save it as separate q / k / v
tensors and fuse them back on load (as TorchTitan's and Hugging Face's fused attention does), on any stack. The
knobs of parallel_gpt.py apply (LOSS_LOG, KILL_AT_STEP, ...).

Environment knobs (tests only):
  LOSSY_LOAD   the load hook fuses the tensors in the wrong order (a state dict that does not round-trip)
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import parallel_gpt  # noqa: E402  (tests/scripts/parallel_gpt.py)

gpt = parallel_gpt.gpt
PARTS = ("wq", "wk", "wv")


class FusedAttention(nn.Module):
    """One `wqkv` projection in the module; `attn.wq.weight`, `attn.wk.weight`, ... in its state dict."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.head_dim = dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.register_state_dict_post_hook(_split)
        self.register_load_state_dict_pre_hook(_fuse)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = (part.view(batch, length, -1, self.head_dim).transpose(1, 2) for part in self.wqkv(x).chunk(3, -1))
        attention = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(attention.transpose(1, 2).reshape(batch, length, -1))


def _split(module, state_dict, prefix, local_metadata):
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}wqkv.{kind}")
        for name, part in zip(PARTS, fused.chunk(3, 0)):
            state_dict[f"{prefix}{name}.{kind}"] = part


def _fuse(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    order = PARTS[::-1] if os.environ.get("LOSSY_LOAD") else PARTS
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in order]
        if all(key in state_dict for key in keys):
            state_dict[f"{prefix}wqkv.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])


class FusedRunner(parallel_gpt.TestRunner):
    def __init__(self, config):
        super().__init__(config)
        torch.manual_seed(config.seed)
        m = config.model
        for block in self.model.layers.values():
            block.attn = FusedAttention(m.dim, m.heads, m.dropout)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.optim.lr)


if __name__ == "__main__":
    FusedRunner(parallel_gpt.Config().parse()).train()
