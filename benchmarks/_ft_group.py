"""One replica group of the `ft_recovery` benchmark: a small MLP whose every step decision is timestamped.

    COMMIT_LOG=path  one line per step attempt: "<unix time> <1 committed | 0 not> <global_step after it> <groups in
                     the quorum>"
    STEP_DELAY=s     seconds of extra work per step (a sleep), so a step takes about as long as a real one

Run by benchmarks/ft_recovery.py with the `--ft.*` keys of its group.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from perdure import Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self):
        super().__init__()
        self.steps = 1_000_000  # the benchmark kills the groups
        self.ckpt.interval = 100
        self.log.interval = 100
        self.dataloader.batch_size = 64


class Group(Runner):
    def __init__(self, config):
        super().__init__(config)
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(8192, 64, generator=generator)
        self.datasets["train"] = TensorDataset(inputs, (inputs[:, 0] > 0).long())
        self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
        self.criterion = nn.CrossEntropyLoss()
        self.delay = float(os.environ.get("STEP_DELAY", "0"))
        self.commit_log = open(os.environ["COMMIT_LOG"], "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def train_step(self, batch):
        if self.delay:
            time.sleep(self.delay)
        return super().train_step(batch)

    def commit_step(self):
        committed = super().commit_step()
        step = self.state.global_step + (1 if committed else 0)
        groups = self.ft_manager.num_participants()
        self.commit_log.write(f"{time.time():.6f} {int(committed)} {step} {groups}\n")
        return committed


if __name__ == "__main__":
    Group(Config().parse()).train()
