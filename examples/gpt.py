"""Train a small GPT on any stack: one process, DDP, FSDP2, tensor parallel, pipeline parallel, or a mix of them.

    python examples/gpt.py                                                           # one process (stack=torch)
    torchrun --nproc_per_node 2 examples/gpt.py                                      # DDP on 2 ranks
    torchrun --nproc_per_node 2 examples/gpt.py --stack parallel                     # FSDP2 over 2 ranks
    torchrun --nproc_per_node 2 examples/gpt.py --stack parallel --parallel.axes.tensor 2    # tensor parallel
    torchrun --nproc_per_node 4 examples/gpt.py --stack parallel --parallel.axes.tensor 2    # FSDP2 x TP (2 x 2)
    torchrun --nproc_per_node 2 examples/gpt.py --stack parallel --parallel.axes.pipeline 2  # 2 pipeline stages

The program is the same on every stack: it builds the whole model, the optimizer over its parameters and the
datasets; the parallel stack shards the model with the two methods a model offers for it, `parallelize(mesh)` (its
tensor-parallel plan) and `pipeline_stage(stage_index, num_stages)` (its split into stages, keeping the parameter
names of the whole model), and rebuilds the optimizer over the sharded parameters.

Data: a synthetic token stream from a fixed random bigram table (learnable: the loss falls well below log(vocab)),
or the bytes of a text file with `--data.text FILE` (vocabulary 256). Kill it at any moment and run the same command
again: it resumes from its last checkpoint, on the same or another number of ranks (see docs/parallel.md).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from perdure import ConfigError, Runner, RunnerConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 200
        self.seed = 1337
        self.ckpt.interval = 50
        self.optim.lr = 3e-3
        self.optim.weight_decay = 0.1
        self.sched.name = "cosine"
        self.sched.warmup_steps = 20
        self.dataloader.batch_size = 8
        self.dataloader.drop_last = True  # every batch splits into equal pipeline microbatches
        self.log.interval = 25
        self.model.layers = 2
        self.model.dim = 32
        self.model.heads = 4
        self.model.block_size = 32
        self.model.dropout = 0.1
        self.data.vocab = 64
        self.data.tokens = 32768
        self.data.text = None  # a text file: train on its bytes instead of the synthetic stream
        self.data.seed = 0

    def check_user_keys(self) -> None:
        if self.model.dim % self.model.heads:
            raise ConfigError("model.dim", self.model.dim, f"use a multiple of model.heads ({self.model.heads})")
        if not 0 <= self.model.dropout < 1:
            raise ConfigError("model.dropout", self.model.dropout, "use a probability in [0, 1)")


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `block_size + 1` tokens of one stream, every `block_size` tokens: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def synthetic_tokens(count: int, vocab: int, seed: int) -> torch.Tensor:
    """A stream drawn from a fixed random bigram table with a few likely successors per token."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator) * 3
    tokens = torch.empty(count, dtype=torch.long)
    tokens[0] = 0
    noise = torch.rand(count, generator=generator)
    cumulative = logits.softmax(-1).cumsum(-1)
    for position in range(1, count):
        row = cumulative[tokens[position - 1]]
        tokens[position] = min(int(torch.searchsorted(row, noise[position])), vocab - 1)
    return tokens


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # Under tensor parallelism q / k / v hold this rank's heads only: the head count follows the local width.
        q, k, v = (lin(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        out: torch.Tensor = self.proj(attention.transpose(1, 2).reshape(batch, length, -1))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        x = x + self.drop(self.out(F.gelu(self.fc(self.norm2(x)))))
        return x


class GPT(nn.Module):
    """Token + position embedding, blocks in a ModuleDict (named by index, so a stage keeps their names), a head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, block_size: int, dropout: float) -> None:
        super().__init__()
        # None on the pipeline stages that do not hold them (`pipeline_stage`)
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.pos_emb: nn.Embedding | None = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleDict({str(index): Block(dim, heads, dropout) for index in range(layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(dim)
        self.head: nn.Linear | None = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage has only some of these parts: the first embeds tokens, the last computes logits.
        if self.tok_emb is not None and self.pos_emb is not None:
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.layers.values():
            x = block(x)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x

    def parallelize(self, mesh: DeviceMesh) -> None:
        """Tensor parallelism (Megatron style): q / k / v and fc split by columns, proj and out by rows, so each
        block all-reduces twice; embeddings, norms and the head stay whole (FSDP shards them over the data axes)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tensor = mesh["tp"]  # the device mesh names its dimensions as TorchTitan does
        # A ModuleDict's values are typed nn.Module; a block may be wrapped (checkpoint_wrapper forwards attributes).
        attention = cast(Block, next(iter(self.layers.values()))).attn
        heads = attention.q.out_features // attention.head_dim
        if heads % tensor.size():
            raise ConfigError("parallel.axes.tensor", tensor.size(), f"use a divisor of model.heads ({heads})")
        plan: dict[str, ParallelStyle] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "fc": ColwiseParallel(),
            "out": RowwiseParallel(),
        }
        for block in self.layers.values():
            parallelize_module(block, tensor, plan)

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """This stage's part of the model: a copy holding its share of the blocks (under their own names), the
        embeddings on the first stage, the norm and head on the last."""
        names = list(self.layers)
        if num_stages > len(names):
            raise ConfigError("parallel.axes.pipeline", num_stages, f"use at most model.layers ({len(names)}) stages")
        per_stage = math.ceil(len(names) / num_stages)
        mine = names[stage_index * per_stage : (stage_index + 1) * per_stage]
        stage = copy.deepcopy(self)
        for name in names:
            if name not in mine:
                del stage.layers[name]
        if stage_index > 0:
            stage.tok_emb = stage.pos_emb = None
        if stage_index < num_stages - 1:
            stage.norm = stage.head = None
        return stage


class TokenLoss(nn.Module):
    """Cross-entropy of next-token logits (batch, length, vocab) against targets (batch, length)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPTRunner(Runner):
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        m, d = config.model, config.data
        if d.text:
            with open(d.text, "rb") as file:
                tokens, vocab = torch.tensor(list(file.read()), dtype=torch.long), 256
        else:
            tokens, vocab = synthetic_tokens(d.tokens, d.vocab, d.seed), d.vocab
        split = int(len(tokens) * 0.9)
        self.model = GPT(vocab, m.dim, m.heads, m.layers, m.block_size, m.dropout)
        self.criterion = TokenLoss()
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=config.optim.lr,
            weight_decay=config.optim.weight_decay,
        )
        self.datasets["train"] = TokenWindows(tokens[:split], m.block_size)
        self.datasets["val"] = TokenWindows(tokens[split:], m.block_size)


if __name__ == "__main__":
    GPTRunner(Config().parse()).train()
