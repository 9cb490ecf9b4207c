"""Train a small MLP on a synthetic classification task: the smallest complete perdure program.

    python examples/mlp.py                          # 300 steps, a checkpoint every 50, ~2 s on a laptop CPU
    python examples/mlp.py --steps 600              # extend the same run: it resumes from step 300
    python examples/mlp.py --optim.lr 1e-2          # a different config is a different run directory
    python examples/mlp.py --help                   # every key, its value and its help line
    python examples/mlp.py --config configs/mlp-tiny.yaml   # a preset (configs/): a few seconds on a CPU

Kill it at any moment (Ctrl-C, `kill -9`, a preempted node) and run the same command again: it continues from its
last checkpoint and ends with exactly the same weights as a run that never stopped.

Everything is made in code (no downloads): noisy Gaussian blobs, several per class, split once into train / val with a
shuffled permutation; perdure shuffles the training order every epoch.

Environment knobs (for demos only, they do not change the maths or the run's identity):
  MLP_STEP_DELAY  seconds to sleep after each micro-batch, so that a kill lands mid-run in `examples/demo.py`
  MLP_EVAL_DELAY  seconds to sleep after each evaluation batch: a long evaluation (docs/resilience.md)
"""

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from perdure import ConfigError, Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        # The comment at the end of a line is that key's help in `--help` (perdure's keys have theirs already).
        self.steps = 300  # optimizer steps
        self.seed = 1337
        self.ckpt.interval = 50  # evaluate and checkpoint every 50 steps
        self.optim.name = "adamw"  # perdure builds AdamW and a warmup + cosine LambdaLR from optim.* and sched.*
        self.optim.lr = 3e-3
        self.optim.weight_decay = 0.01
        self.sched.name = "cosine"
        self.sched.warmup_steps = 30
        self.sched.min_lr_ratio = 0.1
        self.dataloader.batch_size = 64
        self.score.metric = "accuracy"  # "best" is the checkpoint with the highest validation accuracy
        self.score.mode = "max"
        # our own keys: command-line options too (--data.samples 8192, --net.dropout 0.2, ...)
        self.data.samples = 4096  # samples in the synthetic dataset (train + val)
        self.data.features = 32  # features per sample
        self.data.classes = 4  # classes to predict
        self.data.clusters = 4  # Gaussian blobs per class (several: not linearly separable)
        self.data.noise = 1.5  # standard deviation of the blobs
        self.data.val_fraction = 0.125  # share of the samples held out for validation
        self.data.seed = 0  # seed of the data (independent of the run's seed)
        self.net.hidden = 128  # width of the two hidden layers
        self.net.dropout = 0.1  # dropout after each hidden layer

    def check_user_keys(self) -> None:
        # Our own keys are checked like perdure's: after --config and the command line, before anything is written.
        if not 0 < self.data.val_fraction < 1:
            raise ConfigError("data.val_fraction", self.data.val_fraction, "use a fraction in (0, 1), e.g. 0.125")
        if not 0 <= self.net.dropout < 1:
            raise ConfigError("net.dropout", self.net.dropout, "use a probability in [0, 1), e.g. 0.1")


def make_dataset(
    samples: int, features: int, classes: int, clusters: int, noise: float, val_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset]:
    """Gaussian blobs around random centres, `clusters` centres per class (not linearly separable), split into a
    shuffled train / val pair. The generator is seeded here, so the data never depends on the run's seed."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes * clusters, features, generator=g)
    cluster = torch.randint(len(centres), (samples,), generator=g)
    x = centres[cluster] + noise * torch.randn(samples, features, generator=g)
    y = cluster % classes
    perm = torch.randperm(samples, generator=g)
    n_val = int(samples * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class MLPRunner(Runner):
    model: MLP  # narrower than the base's `nn.Module`: the type checker knows what this runner trains
    criterion: nn.CrossEntropyLoss

    def __init__(self, config: Config) -> None:
        super().__init__(config)  # seed, run directory, logging and the checkpoint manager exist after this line
        data, net = config.data, config.net
        self.model = MLP(data.features, net.hidden, data.classes, net.dropout)
        self.criterion = nn.CrossEntropyLoss()
        # no self.optimizer / self.scheduler: perdure builds them from config.optim and config.sched
        self.datasets["train"], self.datasets["val"] = make_dataset(
            data.samples, data.features, data.classes, data.clusters, data.noise, data.val_fraction, data.seed
        )
        self.step_delay = float(os.environ.get("MLP_STEP_DELAY", "0"))
        self.eval_delay = float(os.environ.get("MLP_EVAL_DELAY", "0"))

    # The default train_step (criterion(model(x), y)) is all we need; evaluation also reports accuracy.
    def evaluate_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = self.unpack_batch(batch)
        logits = self.model(x)
        if self.eval_delay:
            time.sleep(self.eval_delay)
        return {"loss": self.criterion(logits, y), "accuracy": (logits.argmax(dim=1) == y).float().mean()}

    def train_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        loss = super().train_step(batch)
        if self.step_delay:
            time.sleep(self.step_delay)
        return loss


if __name__ == "__main__":
    MLPRunner(Config().parse()).train()
