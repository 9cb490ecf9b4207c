"""A small training program the resume and fault tests launch in subprocesses.

Environment knobs (tests only):
  LOSS_LOG      append one JSON line per micro-batch: position and the loss as an exact float hex ("{rank}" in the
                path is replaced by the rank, "{replica}" by ft.replica_id); with SAMPLE_LOG also the sample indices
  FINAL_STATE   after training, torch.save this process's model and optimizer state there ("{rank}" / "{replica}"
                replaced as in LOSS_LOG): replica groups compare their parameters and optimizer states
  STEP_SLEEP    seconds to sleep per micro-batch, so an outside SIGKILL lands mid-run
  EVAL_SLEEP    seconds to sleep per evaluation batch (a long evaluation a signal lands in); each evaluation batch
                then appends {"step"} to EVAL_LOG when set ("{rank}" replaced as in LOSS_LOG)
  VAL_SIZE      samples of the validation split (default 40)
  VAL_ITERABLE  "1": the validation split is a stream without a length, rank r of W reading samples r, r + W, ...
  EVAL_DRAW     "1": each evaluation batch draws from the device's generator (its `draw` metric), as a random
                augmentation would
  SLOW_WHILE    a path: STEP_SLEEP applies only while it exists (a test holds a run back while it stages faults)
  SLOW_RANK     STEP_SLEEP applies on this rank only (a straggler)
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (a deterministic hard death)
  KILL_AFTER_STEPS  SIGKILL this very process at the N-th step it trains itself, wherever a heal put it
  RAISE_AT_STEP raise RuntimeError when `global_step` reaches this value (a bug that fails every attempt alike)
  FAULT         POINT:N — inject a fault at the N-th pass through a point of the checkpoint code
                (POINT:N+ — at every pass from the N-th on):
                  pointer  SIGKILL just before `latest` moves (the checkpoint directory is already committed)
                  prune    SIGKILL in the middle of pruning (a directory renamed aside, not yet deleted)
                  write    SIGKILL half-way through writing a checkpoint file (in the background writer if async)
                  enospc   the write fails with ENOSPC (a full disk) after writing part of the file
                  dcp      SIGKILL half-way through writing a DCP shard file (`*.distcp`; sync and thread modes)
                  dcp_enospc  writing a DCP shard file fails with ENOSPC after part of it is written
                  allreduce  SIGKILL right after launching a cross-group gradient all-reduce (TorchFT), so the peers
                             are inside that all-reduce when this group dies
  FAULT_RANK    install FAULT on this rank only (default: on every rank)
  WRITER_FAULT  POINT:N as FAULT, or "import" (the process fails to start), installed in the checkpoint writer process
                of ckpt.async_mode=process instead, by the first writer process only: it creates WRITER_FAULT_DONE
                (a path), and a writer started after it finds the file and runs clean
  SETUP_FAIL    "model": the runner's __init__ raises while building the model (a failed setup)
  UNSAVEABLE    checkpoints carry a user object that torch.save cannot serialize
  PACKED        "1": every split is collated by a function of the program's own (`self.collate_fns`) into one flat row
                of inputs with the samples' offsets first (a batch whose first tensor is not one row per sample),
                masked at random with torch's generator
  TEACHER       "1": a momentum teacher of the user's own (`self.checkpointed["teacher"]`), updated after every
                optimizer step with a draw from torch's generator; FINAL_STATE then holds its state too
  NAN_AT_STEP   the loss of the first micro-batch at this global step is NaN (on rank NAN_RANK only, default every rank)
  GATHERED_WEIGHTS  stack=deepspeed: after training, rank 0 saves the engine's fp32 weights gathered from every rank
                (`safe_get_full_fp32_param`) to this path
  RESTORED_STATE  stack=deepspeed: the same, right after the restore (before training), with the optimizer's steps
  DS_FP16_SUPPORTED  stack=deepspeed: "1" or "0" overrides whether DeepSpeed's accelerator reports fp16 support (a CPU
                without oneDNN fp16 kernels has none; torch's own fp16 CPU kernels still compute a tiny model's steps)
  AUGMENT       "1": each training sample gets noise drawn from torch's, Python's and numpy's global generators, as a
                random transform does (in the dataloader's workers where it has them)
  TRAIN_EXTRA   samples the train split has beyond `dataset_size` (outside the config: data added between attempts)
  ITERABLE      "stateful": the train set is a stream (an IterableDataset, reshuffled each pass, each rank reading its
                own shard) that saves its position; "stateless": the same stream without state_dict
"""

import contextlib
import copy
import errno
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from perdure import ConfigError, Runner, RunnerConfig
from perdure.checkpoints.async_save import WRITER_PROCESS_NAME


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

    def __init__(self, size: int, seed: int, augment: bool = False):
        self.augment = augment
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 16, generator=generator)
        self.targets = (self.inputs[:, :8].sum(1) > self.inputs[:, 8:].sum(1)).long()

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        inputs = self.inputs[index]
        if self.augment:
            noise = torch.rand(16) + random.random() + float(numpy.random.rand())
            inputs = inputs + 0.1 * noise
        if os.environ.get("SAMPLE_LOG"):
            return {"input": inputs, "target": self.targets[index], "index": index}
        return inputs, self.targets[index]


class StatelessStream(IterableDataset):
    """`Synthetic` as a stream: rank r of W reads samples r, r + W, ... in an order reshuffled at every pass."""

    def __init__(self, size: int, seed: int, rank: int, world_size: int, augment: bool = False):
        self.data = Synthetic(size, seed, augment)
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


class OrderedStream(IterableDataset):
    """`Synthetic` as a stream without a length: rank r of W reads samples r, r + W, ... in order, every pass alike."""

    def __init__(self, size: int, seed: int, rank: int, world_size: int):
        self.data = Synthetic(size, seed)
        self.shard = range(rank, size, world_size)

    def __iter__(self):
        return (self.data[index] for index in self.shard)


class Unsaveable:
    """A user object whose state holds a function defined in a method: torch.save cannot pickle it."""

    def state_dict(self):
        return {"callback": lambda: 0}

    def load_state_dict(self, state):
        pass


def packed(samples):
    """A collate of the user's own: the samples' inputs in one flat row, their offsets first (as variable-length
    attention takes them), each input masked at random with torch's generator (in the worker that collates, if any)."""
    inputs = torch.stack([inputs for inputs, _ in samples])
    inputs = inputs * (torch.rand(inputs.shape) > 0.1)
    offsets = torch.arange(len(samples) + 1) * inputs.shape[1]
    return {"offsets": offsets, "input": inputs.reshape(-1), "target": torch.stack([target for _, target in samples])}


class MomentumTeacher:
    """A user object the runner knows nothing of: a copy of the model that follows it, and a running centre."""

    def __init__(self, model: nn.Module):
        self.net = copy.deepcopy(model).requires_grad_(False)
        self.center = torch.zeros(2)
        self.updates = 0

    def update(self, model: nn.Module) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.net.parameters(), model.parameters()):
                mine.lerp_(theirs.detach().to(mine.device), 0.1)
            self.center.mul_(0.9).add_(torch.rand(2), alpha=0.1)
        self.updates += 1

    def state_dict(self):
        return {"net": self.net.state_dict(), "center": self.center, "updates": self.updates}

    def load_state_dict(self, state):
        self.net.load_state_dict(state["net"])
        self.center.copy_(state["center"])
        self.updates = state["updates"]


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
        self.teacher = MomentumTeacher(self.model) if os.environ.get("TEACHER") == "1" else None
        if self.teacher is not None:
            self.checkpointed["teacher"] = self.teacher
        train_size = config.dataset_size + int(os.environ.get("TRAIN_EXTRA", "0"))
        self.datasets["train"] = Synthetic(train_size, seed=1, augment=os.environ.get("AUGMENT") == "1")
        if os.environ.get("ITERABLE"):
            stream = Stream if os.environ["ITERABLE"] == "stateful" else StatelessStream
            augment = os.environ.get("AUGMENT") == "1"
            self.datasets["train"] = stream(config.dataset_size, 1, self.rank, self.world_size, augment)
        val_size = int(os.environ.get("VAL_SIZE", "40"))
        self.datasets["val"] = Synthetic(val_size, seed=2)
        if os.environ.get("VAL_ITERABLE") == "1":
            shard, shards = self.data_shard()
            self.datasets["val"] = OrderedStream(val_size, 2, shard, shards)
        if os.environ.get("PACKED") == "1":
            self.collate_fns = dict.fromkeys(self.datasets, packed)
        self.loss_log = _per_process(os.environ.get("LOSS_LOG", ""), self.rank, config) or None
        self.step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
        self.slow_while = os.environ.get("SLOW_WHILE")
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self.kill_after = int(os.environ.get("KILL_AFTER_STEPS", "-1"))
        self._steps_here = 0
        self.nan_at = int(os.environ.get("NAN_AT_STEP", "-1"))
        self.nan_here = os.environ.get("NAN_RANK", str(self.rank)) == str(self.rank)
        self._nan_done = False
        self._position = None
        self._micro = 0
        self.eval_sleep = float(os.environ.get("EVAL_SLEEP", "0"))
        self.eval_log = _per_process(os.environ.get("EVAL_LOG", ""), self.rank, config) or None
        self.eval_draw = os.environ.get("EVAL_DRAW") == "1"

    def checkpoint_states(self):
        states = super().checkpoint_states()
        if os.environ.get("UNSAVEABLE"):
            states["user"] = Unsaveable()
        return states

    def unpack_batch(self, batch):
        if isinstance(batch, dict) and "offsets" in batch:  # PACKED: one row per sample again
            rows = len(batch["offsets"]) - 1
            batch = {"input": batch["input"].reshape(rows, -1), "target": batch["target"]}
        return super().unpack_batch(batch)

    def optimizer_step(self):
        stepped = super().optimizer_step()
        if stepped and self.teacher is not None:
            self.teacher.update(self.unwrap_model())
        return stepped

    def train_step(self, batch):
        if self.state.global_step == int(os.environ.get("RAISE_AT_STEP", "-1")):
            raise RuntimeError(f"boom at step {self.state.global_step}")
        self._steps_here += 1
        if self.state.global_step == self.kill_at or self._steps_here == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().train_step(batch)
        if self.state.global_step == self.nan_at and self.nan_here and not self._nan_done:
            self._nan_done = True  # one window only: the skipped step is retried with the next batches
            loss = loss * float("nan")
        position = (self.state.epoch, self.state.global_step)
        self._micro = self._micro + 1 if position == self._position else 0
        self._position = position
        if self.loss_log:
            with open(self.loss_log, "a") as log:
                record = {"epoch": position[0], "step": position[1], "micro": self._micro, "loss": loss.item().hex()}
                if isinstance(batch, dict) and "index" in batch:
                    record["samples"] = batch["index"].tolist()
                log.write(json.dumps(record) + "\n")
        slow_here = os.environ.get("SLOW_RANK") in (None, str(self.rank))
        if self.step_sleep and slow_here and (self.slow_while is None or os.path.exists(self.slow_while)):
            time.sleep(self.step_sleep)
        return loss

    def evaluate_step(self, batch):
        metrics = dict(super().evaluate_step(batch))
        if self.eval_draw:
            metrics["draw"] = float(torch.rand((), device=self.device))  # the CUDA generator on a GPU
        if self.eval_log:
            with open(self.eval_log, "a") as log:
                log.write(json.dumps({"step": self.state.global_step}) + "\n")
        time.sleep(self.eval_sleep)
        return metrics


def _per_process(path: str, rank: int, config) -> str:
    return path.replace("{rank}", str(rank)).replace("{replica}", str(config.ft.replica_id))


def save_final_state(runner) -> None:
    path = _per_process(os.environ.get("FINAL_STATE", ""), runner.rank, runner.config)
    if path:  # sharded (stack=parallel): this rank's shards, which rank r of every replica group holds alike
        from perdure.ft.manager import local_shards

        model = local_shards(runner.unwrap_model().state_dict())
        optimizer = local_shards(runner.optimizer.state_dict())
        state = {"model": model, "optimizer": optimizer, "step": runner.global_step}
        if runner.teacher is not None:
            state["teacher"] = runner.teacher.state_dict()
        torch.save(state, path)


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

    if point == "allreduce":
        from perdure.ft import manager as ft_manager

        average = ft_manager.GradientAverager.average

        def killing_average(self, manager):
            if not due():
                return average(self, manager)
            allreduce = manager.allreduce

            def launch_and_die(tensor):
                allreduce(tensor)  # the peers now wait inside this all-reduce
                die()

            manager.allreduce = launch_and_die
            return average(self, manager)

        ft_manager.GradientAverager.average = killing_average
    elif point == "pointer":
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


def save_gathered(runner, path) -> None:
    """stack=deepspeed: the engine's fp32 weights gathered from every rank (collective), the optimizer's steps, and the
    EMA's whole shadows with ema.enabled (gathered too under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {name: safe_get_full_fp32_param(p).clone() for name, p in runner.engine.module.named_parameters()}
    steps = sorted({float(state["step"]) for state in runner.engine.optimizer.optimizer.state.values()})
    ema = runner.ema.weights() if runner.ema is not None else None
    if runner.rank == 0:
        torch.save({"weights": weights, "steps": steps, "ema": ema}, path)


def install_writer_fault(spec: str, done: Path) -> None:
    if done.exists():
        return
    done.touch()
    if spec == "import":
        raise ImportError("this writer process cannot start (injected by the test)")
    install_fault(spec)


if os.environ.get("WRITER_FAULT") and multiprocessing.current_process().name == WRITER_PROCESS_NAME:
    install_writer_fault(os.environ["WRITER_FAULT"], Path(os.environ["WRITER_FAULT_DONE"]))


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    if os.environ.get("FAULT") and os.environ.get("FAULT_RANK", rank) == rank:
        install_fault(os.environ["FAULT"])
    if os.environ.get("DS_FP16_SUPPORTED"):
        from deepspeed.accelerator import get_accelerator

        from perdure.distributed.deepspeed_env import import_deepspeed

        import_deepspeed()  # the accelerator chosen and the comm op disabled, as the runner imports it
        supported = os.environ["DS_FP16_SUPPORTED"] == "1"
        get_accelerator().is_fp16_supported = lambda: supported
    runner = ResumableRunner(Config().parse())
    if os.environ.get("RESTORED_STATE"):
        save_gathered(runner, os.environ["RESTORED_STATE"])
    runner.train()
    if os.environ.get("GATHERED_WEIGHTS"):
        save_gathered(runner, os.environ["GATHERED_WEIGHTS"])
    save_final_state(runner)
