"""Stream a tokenized file with a saved position: an IterableDataset that resumes exactly where it was.

    python examples/stream_tokens.py                       # tokenizes a standard-library file once, then trains
    python examples/stream_tokens.py --steps 400           # extend: the stream continues from its saved position
    torchrun --nproc_per_node=2 examples/stream_tokens.py  # each rank streams its own share of the windows

A corpus too large for memory is usually tokenized once into a flat binary file and read as a stream. Here the file
is the standard library's `_pydecimal.py`, tokenized by character into `uint16` tokens (`data.tokens`, written once,
atomically). `TokenStream` memory-maps it and yields windows of `data.block_size + 1` tokens; rank r of W reads the
windows r, r + W, r + 2W, ... Its position (the next window of this rank, and how many passes are done) is what
`state_dict()` returns: perdure saves it in every checkpoint, per rank, and hands it back to `load_state_dict()`
before the resumed run reads on. A resumed run therefore reads exactly the windows the uninterrupted run would have.

The model is deliberately small (a bigram-style language model): the subject is the data path.
"""

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import IterableDataset

from perdure import Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 300
        self.seed = 1337
        self.ckpt.interval = 100
        self.log.interval = 50
        self.optim.lr = 3e-3
        self.dataloader.batch_size = 32
        self.data.text = None  # the text to tokenize; None: the standard library's _pydecimal.py
        self.data.tokens = "runs/data/pydecimal.u16"  # the tokenized file (written once if missing)
        self.data.block_size = 32  # tokens per training window
        self.net.width = 64  # embedding width


def tokenize(text_path: str | None, tokens_path: str | Path) -> None:
    """Write the text's characters as uint16 tokens (and the vocabulary beside them), once, atomically."""
    tokens_path = Path(tokens_path)
    if tokens_path.exists():
        return
    text = Path(text_path or Path(sysconfig.get_paths()["stdlib"]) / "_pydecimal.py").read_text(encoding="utf-8")
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = tokens_path.with_name(f".{tokens_path.name}.{os.getpid()}.tmp")
    np.array([index[char] for char in text], dtype=np.uint16).tofile(temporary)
    os.replace(temporary, tokens_path)  # every rank may do this: the content is the same


class TokenStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `block_size + 1` tokens of a flat uint16 file, this rank's share, in file order, pass after pass."""

    def __init__(self, path: str | Path, block_size: int, rank: int, world_size: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size, self.rank, self.world_size = block_size, rank, world_size
        self.windows = (len(self.tokens) - 1) // block_size
        self.window = rank  # the next window this rank reads
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.window < self.windows:
            start = self.window * self.block_size
            chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
            self.window += self.world_size
            yield chunk[:-1], chunk[1:]
        self.window, self.passes = self.rank, self.passes + 1  # the pass is over: the next one starts at the top

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "passes": self.passes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window, self.passes = state["window"], state["passes"]


class Bigram(nn.Module):
    def __init__(self, vocabulary: int, width: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.embedding(tokens)))
        return logits


class StreamRunner(Runner):
    model: Bigram  # narrower than the base's `nn.Module`

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        tokenize(config.data.text, config.data.tokens)
        stream = TokenStream(config.data.tokens, config.data.block_size, self.rank, self.world_size)
        self.datasets["train"] = stream
        self.model = Bigram(int(stream.tokens.max()) + 1, config.net.width)

    def train_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = self.to_device(batch)
        return F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())

    def batch_tokens(self, batch: Any) -> int:
        inputs: torch.Tensor = batch[0]
        return inputs.numel()


if __name__ == "__main__":
    StreamRunner(Config().parse()).train()
