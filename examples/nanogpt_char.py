"""A character-level GPT, trained on a text file that ships with Python: a real model as a perdure program.

    python examples/nanogpt_char.py --config configs/nanogpt_char-tiny.yaml   # CPU: ~100 steps in a minute or two
    python examples/nanogpt_char.py --config configs/nanogpt_char.yaml        # one GPU: a 10M-parameter model
    python examples/nanogpt_char.py --config configs/nanogpt_char-tiny.yaml --help

The text defaults to the standard library's `_pydecimal.py` (~230 KB of Python source, so nothing is downloaded);
`--data.path FILE` trains on any text file. Every character offset of the training part is one sample (a window of
`gpt.block_size` characters and the same window shifted by one as its target), so an epoch has as many samples as
the text has characters; the validation part is cut into disjoint windows, and each evaluation reads its first
`eval.steps` batches: the same characters at every evaluation, whatever the budget.

The log lines carry tokens/s and MFU: the runner counts a batch's tokens (`batch_tokens`) and knows the model's
FLOPs per token (`flops_per_token`, 6 x parameters + attention, as in the PaLM paper's appendix B); the peak comes
from perdure's table of GPUs, or `perf.peak_flops` on a CPU. The model is compiled (`compile.enabled`), and a run
killed at any moment resumes bit for bit, compiled or not.
"""

import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from perdure import ConfigError, Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 2000  # optimizer steps
        self.seed = 1337
        self.precision = "bf16"  # autocast on a GPU that has bf16; use fp32 on a CPU
        self.max_grad_norm = 1.0
        self.ckpt.interval = 250
        self.eval.interval = 250
        self.eval.steps = 20  # each evaluation reads the first 20 batches of val: the same characters every time
        self.log.interval = 10
        self.compile.enabled = True
        self.optim.lr = 1e-3
        self.optim.weight_decay = 0.1  # applied to matrices only (embeddings and linear weights)
        self.optim.betas = [0.9, 0.99]
        self.sched.name = "cosine"
        self.sched.warmup_steps = 100
        self.sched.min_lr_ratio = 0.1
        self.dataloader.batch_size = 64
        self.data.path = None  # a text file; None: the standard library's _pydecimal.py
        self.data.val_fraction = 0.1  # the end of the text held out for evaluation
        self.gpt.block_size = 256  # characters of context
        self.gpt.n_layer = 6  # transformer blocks
        self.gpt.n_head = 6  # attention heads per block
        self.gpt.n_embd = 384  # width of the residual stream
        self.gpt.dropout = 0.2  # dropout in attention, MLP and embeddings
        self.sample.length = 200  # characters generated at the end of training (0: none)

    def check_user_keys(self) -> None:
        if self.gpt.n_embd % self.gpt.n_head:
            raise ConfigError("gpt.n_embd", self.gpt.n_embd, f"use a multiple of gpt.n_head ({self.gpt.n_head})")
        if not 0 < self.data.val_fraction < 1:
            raise ConfigError("data.val_fraction", self.data.val_fraction, "use a fraction in (0, 1), e.g. 0.1")
        if self.data.path is not None and not Path(self.data.path).is_file():
            raise ConfigError("data.path", self.data.path, "give a text file, or none for the bundled one")


def read_text(path: str | None) -> str:
    """The training text: `path`, or the standard library's `_pydecimal.py`."""
    return Path(path or Path(sysconfig.get_paths()["stdlib"]) / "_pydecimal.py").read_text(encoding="utf-8")


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `block_size` characters and their next-character targets, one every `stride` characters."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int = 1) -> None:
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (
            part.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        out: torch.Tensor = self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, width)))
        return out


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=False),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size, self.n_layer, self.n_head, self.n_embd = block_size, n_layer, n_head, n_embd
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied input and output embeddings
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:  # residual projections scaled down with depth (GPT-2)
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(parameter, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per parameter (forward and backward; position embeddings excluded, they are
        a lookup) plus attention's 12 x layers x heads x head size x context."""
        parameters = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        return 6 * parameters + 12 * self.n_layer * self.n_embd * self.block_size


class CharGPTRunner(Runner):
    model: GPT  # narrower than the base's `nn.Module`

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        text = read_text(config.data.path)
        self.chars = sorted(set(text))
        index = {char: i for i, char in enumerate(self.chars)}
        tokens = torch.tensor([index[char] for char in text], dtype=torch.int16)
        split = int(len(tokens) * (1 - config.data.val_fraction))
        gpt = config.gpt
        self.datasets["train"] = CharWindows(tokens[:split], gpt.block_size)
        self.datasets["val"] = CharWindows(tokens[split:], gpt.block_size, stride=gpt.block_size)
        self.model = GPT(len(self.chars), gpt.block_size, gpt.n_layer, gpt.n_head, gpt.n_embd, gpt.dropout)
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        others = [p for p in self.model.parameters() if p.dim() < 2]
        optim = config.optim
        groups: list[dict[str, Any]] = [
            {"params": matrices, "weight_decay": optim.weight_decay},
            {"params": others, "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
        )
        # no self.scheduler: perdure builds the warmup + cosine schedule from sched.*

    def train_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = self.to_device(batch)
        logits: torch.Tensor = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def evaluate_step(self, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": self.train_step(batch)}

    def batch_tokens(self, batch: Any) -> int:
        inputs: torch.Tensor = batch[0]
        return inputs.numel()

    def flops_per_token(self) -> float:
        model = self.unwrap_model()
        assert isinstance(model, GPT)  # the model built in __init__, without the stack's wrappers (compile, DDP)
        return model.flops_per_token()

    @torch.no_grad()
    def generate(self, length: int, prompt: str = "\n") -> str:
        """`length` characters sampled after `prompt`, in eager mode (no compile for a growing context)."""
        model = self.unwrap_model()
        assert isinstance(model, GPT)
        was_training = model.training
        model.eval()
        index = {char: i for i, char in enumerate(self.chars)}
        idx = torch.tensor([[index[char] for char in prompt]], device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        with torch.compiler.set_stance("force_eager"), self.autocast():
            for _ in range(length):
                logits = model(idx[:, -model.block_size :])[:, -1, :].float()
                probabilities = F.softmax(logits, dim=-1)
                idx = torch.cat([idx, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
        model.train(was_training)
        return "".join(self.chars[i] for i in idx[0, len(prompt) :].tolist())


if __name__ == "__main__":
    config = Config().parse()
    runner = CharGPTRunner(config)
    runner.train()
    if config.sample.length and runner.is_main_process:
        runner.logger.info("sample:\n%s", runner.generate(config.sample.length))
