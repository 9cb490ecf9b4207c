"""A causal language model on variable-length sequences, padded per batch, with the token-weighted loss.

    python examples/padded_lm.py                                   # one process
    torchrun --nproc_per_node 2 examples/padded_lm.py              # DDP on 2 ranks: the same loss, the same gradient

Batches are dicts as a Hugging Face model takes them (`input_ids`, `attention_mask`, `labels`), made by a collate
function of the runner's (`self.collate_fns`): each batch is padded to its longest sequence, and padded positions get
the label -100 (ignored). With `loss.normalize=tokens`, `train_step` returns the *sum* of the per-token losses and
`loss_tokens` counts the tokens it summed: the runner divides by the target tokens of the whole accumulation window on
all ranks, so every token weighs the same, as Hugging Face Trainer's `num_items_in_batch` makes it (a mean per micro-
batch would give the tokens of a short batch more weight than those of a long one). See docs/quickstart.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from perdure import ConfigError, Runner, RunnerConfig

IGNORE = -100  # the label of a padded position (torch's and Hugging Face's ignore_index)


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 60
        self.seed = 7
        self.accum_steps = 2
        self.loss.normalize = "tokens"
        self.optim.lr = 1e-2
        self.dataloader.batch_size = 4
        self.ckpt.interval = 20
        self.log.interval = 10
        self.model.vocab = 32
        self.model.dim = 32
        self.data.sequences = 256
        self.data.min_length = 4
        self.data.max_length = 24

    def check_user_keys(self) -> None:
        if not 2 <= self.data.min_length <= self.data.max_length:
            fix = f"use 2 <= data.min_length <= data.max_length ({self.data.max_length})"
            raise ConfigError("data.min_length", self.data.min_length, fix)


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Sequences of random lengths that follow a fixed rule with some noise (learnable), as `input_ids` only."""

    def __init__(self, count: int, vocab: int, min_length: int, max_length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_length, max_length + 1, (count,), generator=generator)
        self.samples: list[torch.Tensor] = []
        for length in lengths.tolist():
            tokens = [int(torch.randint(vocab, (), generator=generator))]
            for _ in range(length - 1):
                noise = int(torch.randint(4, (), generator=generator)) == 0
                step = int(torch.randint(vocab, (), generator=generator)) if noise else (3 * tokens[-1] + 1) % vocab
                tokens.append(step)
            self.samples.append(torch.tensor(tokens))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.samples[index]}


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A list of `{"input_ids": 1-D tensor}` as one batch padded to its longest sequence (padding on the right)."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens = sample["input_ids"]
        input_ids[row, : len(tokens)] = tokens
        attention_mask[row, : len(tokens)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class TinyCausalLM(nn.Module):
    """Embedding, a GRU (causal: position t sees positions <= t, so right padding changes no real token's output)
    and a head: `forward(input_ids) -> logits`."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        logits: torch.Tensor = self.head(hidden)
        return logits


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the batch's target tokens of the next-token cross-entropy (labels shifted by one; -100 ignored)
    and the number of those tokens."""
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (targets != IGNORE).sum()


class LMRunner(Runner):
    model: TinyCausalLM  # narrower than the base's `nn.Module`

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.model = TinyCausalLM(config.model.vocab, config.model.dim)
        data = config.data
        for split, count, seed in (("train", data.sequences, 0), ("val", max(data.sequences // 8, 8), 1)):
            self.datasets[split] = Sequences(count, config.model.vocab, data.min_length, data.max_length, seed)
            self.collate_fns[split] = pad_batch

    def train_step(self, batch: Any) -> torch.Tensor:
        batch = self.to_device(batch)
        loss, _ = summed_loss(self.model(batch["input_ids"]), batch["labels"])
        return loss  # a sum: loss.normalize=tokens divides it by the window's tokens on all ranks

    def loss_tokens(self, batch: Any) -> torch.Tensor:
        labels: torch.Tensor = batch["labels"]
        return (labels[:, 1:] != IGNORE).sum()  # exactly the tokens train_step sums

    def evaluate_step(self, batch: Any) -> dict[str, torch.Tensor]:
        batch = self.to_device(batch)
        loss, tokens = summed_loss(self.model(batch["input_ids"]), batch["labels"])
        return {"loss": loss / tokens}


if __name__ == "__main__":
    LMRunner(Config().parse()).train()
