"""A small training program the resume and fault tests launch in subprocesses.

Environment knobs (tests only):
  LOSS_LOG      append one JSON line per micro-batch: position and the loss as an exact float hex
  STEP_SLEEP    seconds to sleep per micro-batch, so an outside SIGKILL lands mid-run
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (a deterministic hard death)
"""

import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from perdure import Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self):
        super().__init__()
        self.ckpt.interval = 10
        self.dataloader.batch_size = 8
        self.dataset_size = 100
        self.width = 32
        self.dropout = 0.2


class Synthetic(Dataset):
    """Deterministic samples: a fixed random regression-to-class problem."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 16, generator=generator)
        self.targets = (self.inputs[:, :8].sum(1) > self.inputs[:, 8:].sum(1)).long()

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


class ResumableRunner(Runner):
    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Sequential(
            nn.Linear(16, config.width), nn.ReLU(), nn.Dropout(config.dropout), nn.Linear(config.width, 2)
        )
        self.criterion = nn.CrossEntropyLoss()
        self.datasets["train"] = Synthetic(config.dataset_size, seed=1)
        self.datasets["val"] = Synthetic(40, seed=2)
        self.loss_log = os.environ.get("LOSS_LOG")
        self.step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self._position = None
        self._micro = 0

    def train_step(self, batch):
        if self.state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().train_step(batch)
        position = (self.state.epoch, self.state.global_step)
        self._micro = self._micro + 1 if position == self._position else 0
        self._position = position
        if self.loss_log:
            with open(self.loss_log, "a") as log:
                record = {"epoch": position[0], "step": position[1], "micro": self._micro, "loss": loss.item().hex()}
                log.write(json.dumps(record) + "\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss


if __name__ == "__main__":
    ResumableRunner(Config().parse()).train()
