"""A small classifier on stack=deepspeed whose model is built under `self.init_module()` (ZeRO-3: partitioned as it
is built, `deepspeed.zero.Init`), as tests launch it. The config and data are tests/scripts/resumable.py's.

Environment knobs (tests only):
  BUILD         partitioned (default): under `self.init_module()`; eager: built whole on every rank
  LOSS_LOG      append one JSON line per micro-batch: position and the loss as an exact float hex ("{rank}" replaced)
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (every rank at the same step)

Each rank prints how many parameter values it holds once the model is built.
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resumable import Config, Synthetic  # noqa: E402  (tests/scripts/resumable.py)

from perdure import Runner  # noqa: E402


class ZeroInitRunner(Runner):
    def __init__(self, config):
        super().__init__(config)
        partitioned = os.environ.get("BUILD", "partitioned") == "partitioned"
        with self.init_module() if partitioned else contextlib.nullcontext():
            width = config.width
            self.model = nn.Sequential(
                nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2)
            )
        held = sum(parameter.numel() for parameter in self.model.parameters())
        print(f"rank {self.rank} holds {held} parameter values once the model is built", flush=True)
        self.criterion = nn.CrossEntropyLoss()
        self.datasets["train"] = Synthetic(config.dataset_size, seed=1)
        self.loss_log = os.environ.get("LOSS_LOG", "").replace("{rank}", str(self.rank))
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self._position, self._micro = None, 0

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
        return loss


if __name__ == "__main__":
    ZeroInitRunner(Config().parse()).train()
