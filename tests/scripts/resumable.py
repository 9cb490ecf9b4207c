"""A small training program the resume and fault tests launch in subprocesses.

Environment knobs (tests only):
  LOSS_LOG      append one JSON line per micro-batch: position and the loss as an exact float hex ("{rank}" in the
                path is replaced by the rank, for multi-rank runs); with SAMPLE_LOG also the sample indices
  STEP_SLEEP    seconds to sleep per micro-batch, so an outside SIGKILL lands mid-run
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (a deterministic hard death)
  FAULT         POINT:N — inject a fault at the N-th pass through a point of the checkpoint code
                (POINT:N+ — at every pass from the N-th on):
                  pointer  SIGKILL just before `latest` moves (the checkpoint directory is already committed)
                  prune    SIGKILL in the middle of pruning (a directory renamed aside, not yet deleted)
                  write    SIGKILL half-way through writing a checkpoint file (in the background writer if async)
                  enospc   the write fails with ENOSPC (a full disk) after writing part of the file
                  dcp      SIGKILL half-way through writing a DCP shard file (`*.distcp`; sync and thread modes)
                  dcp_enospc  writing a DCP shard file fails with ENOSPC after part of it is written
  FAULT_RANK    install FAULT on this rank only (default: on every rank)
  SETUP_FAIL    "model": the runner's __init__ raises while building the model (a failed setup)
  UNSAVEABLE    checkpoints carry a user object that torch.save cannot serialize
  ITERABLE      "stateful": the train set is a stream (an IterableDataset, reshuffled each pass, each rank reading its
                own shard) that saves its position; "stateless": the same stream without state_dict
"""

import contextlib
import errno
import json
import os
import shutil
import signal
import time

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from perdure import ConfigError, Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self):
        super().__init__()
        self.ckpt.interval = 10
        self.dataloader.batch_size = 8
        self.dataset_size = 100
        self.width = 32
        self.depth = 0
        self.dropout = 0.2

    def check_user_keys(self):
        size, batch = self.dataset_size, self.dataloader.batch_size
        if not isinstance(size, int) or size < batch:
            fix = f"use at least {batch} samples (one batch), e.g. --dataset_size 100"
            raise ConfigError("dataset_size", size, fix)


def make_config(root, **settings) -> Config:
    """A config for in-process tests: workspace under `root`, then `dotted.key=value` settings in order."""
    config = Config()
    config.workspace.root = str(root)
    config.workspace.code_id = "tests"  # the run dir does not change while the checkout is edited (tests/runs.py)
    for key, value in settings.items():
        config[key] = value
    return config


class Synthetic(Dataset):
    """Deterministic samples: a fixed random regression-to-class problem."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 16, generator=generator)
        self.targets = (self.inputs[:, :8].sum(1) > self.inputs[:, 8:].sum(1)).long()

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if os.environ.get("SAMPLE_LOG"):
            return {"input": self.inputs[index], "target": self.targets[index], "index": index}
        return self.inputs[index], self.targets[index]


class StatelessStream(IterableDataset):
    """`Synthetic` as a stream: rank r of W reads samples r, r + W, ... in an order reshuffled at every pass."""

    def __init__(self, size: int, seed: int, rank: int, world_size: int):
        self.data = Synthetic(size, seed)
        self.shard = list(range(rank, size, world_size))
        self.position = 0  # samples of this pass already yielded
        self.passes = 0

    def __iter__(self):
        order = torch.randperm(len(self.shard), generator=torch.Generator().manual_seed(1000 + self.passes)).tolist()
        while self.position < len(order):
            index = self.shard[order[self.position]]
            self.position += 1
            yield self.data[index]
        self.position = 0
        self.passes += 1


class Stream(StatelessStream):
    def state_dict(self):
        return {"position": self.position, "passes": self.passes}

    def load_state_dict(self, state):
        self.position, self.passes = state["position"], state["passes"]


class Unsaveable:
    """A user object whose state holds a function defined in a method: torch.save cannot pickle it."""

    def state_dict(self):
        return {"callback": lambda: 0}

    def load_state_dict(self, state):
        pass


class ResumableRunner(Runner):
    def __init__(self, config):
        super().__init__(config)
        if os.environ.get("SETUP_FAIL") == "model":
            raise ValueError(f"cannot build the model: width {config.width} is reserved")
        hidden = [layer for _ in range(config.depth) for layer in (nn.Linear(config.width, config.width), nn.ReLU())]
        self.model = nn.Sequential(
            nn.Linear(16, config.width), nn.ReLU(), *hidden, nn.Dropout(config.dropout), nn.Linear(config.width, 2)
        )
        self.criterion = nn.CrossEntropyLoss()
        self.datasets["train"] = Synthetic(config.dataset_size, seed=1)
        if os.environ.get("ITERABLE"):
            stream = Stream if os.environ["ITERABLE"] == "stateful" else StatelessStream
            self.datasets["train"] = stream(config.dataset_size, 1, self.rank, self.world_size)
        self.datasets["val"] = Synthetic(40, seed=2)
        self.loss_log = os.environ.get("LOSS_LOG", "").replace("{rank}", str(self.rank)) or None
        self.step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self._position = None
        self._micro = 0

    def checkpoint_states(self):
        states = super().checkpoint_states()
        if os.environ.get("UNSAVEABLE"):
            states["user"] = Unsaveable()
        return states

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
                if isinstance(batch, dict):
                    record["samples"] = batch["index"].tolist()
                log.write(json.dumps(record) + "\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss


def install_fault(spec: str) -> None:
    import perdure.checkpoints.base as manager_module
    import perdure.checkpoints.file as file_module
    from perdure.checkpoints.retire import PRUNE_PREFIX

    point, nth = spec.split(":")
    calls = {"count": 0}

    def due() -> bool:  # "N": the N-th call only; "N+": every call from the N-th on (a disk that stays full)
        calls["count"] += 1
        return calls["count"] >= int(nth[:-1]) if nth.endswith("+") else calls["count"] == int(nth)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "pointer":
        write_pointer = manager_module.write_pointer

        def killing_write_pointer(root, pointer, target):
            if pointer == "latest" and due():
                die()
            return write_pointer(root, pointer, target)

        manager_module.write_pointer = killing_write_pointer
    elif point == "prune":
        rmtree = shutil.rmtree

        def killing_rmtree(path, *args, **kwargs):
            if os.path.basename(path).startswith(PRUNE_PREFIX) and due():
                die()
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = killing_rmtree
    elif point in ("write", "enospc"):
        write_file = file_module.write_file

        def failing_write_file(path, write):
            if not due():
                return write_file(path, write)
            with open(path, "xb") as partial:
                partial.write(b"\0" * 4096)
            if point == "write":
                die()
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test)", str(path))

        file_module.write_file = failing_write_file
    elif point in ("dcp", "dcp_enospc"):
        from torch.distributed.checkpoint import filesystem

        create_stream = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def failing_create_stream(self, path, mode):
            with create_stream(self, path, mode) as stream:
                if str(path).endswith(".distcp") and due():
                    stream.write(b"\0" * 4096)
                    stream.flush()
                    if point == "dcp":
                        die()
                    raise OSError(errno.ENOSPC, "No space left on device (injected by the test)", str(path))
                yield stream

        filesystem.FileSystem.create_stream = failing_create_stream
    else:
        raise ValueError(f"unknown fault point {point!r}")


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    if os.environ.get("FAULT") and os.environ.get("FAULT_RANK", rank) == rank:
        install_fault(os.environ["FAULT"])
    ResumableRunner(Config().parse()).train()
