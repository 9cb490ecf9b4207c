"""examples/gpt.py as the parallel tests launch it: a tiny GPT, with test knobs. The same program runs on every stack.

Environment knobs (tests only):
  LOSS_LOG      append one JSON line per optimizer step: epoch, step and the window's loss as an exact float hex
                ("{rank}" in the path is replaced by the rank)
  SAMPLE_LOG    append the sample indices of every batch this rank reads, when it is the first reader of its data
                rank (pipeline stage 0, position 0 of the model-parallel axes)
  STEP_SLEEP    seconds to sleep per window, so that a signal lands mid-run
  EVAL_SLEEP    seconds to sleep per evaluation batch (a long evaluation a signal lands in); with EVAL_LOG, each
                evaluation batch appends {"step"} there ("{rank}" replaced as in LOSS_LOG)
  KILL_AT_STEP  SIGKILL this very process when `global_step` reaches this value (every rank does it at the same step)
  RENAMING_STAGE  the model's pipeline_stage renames its blocks (what the runner must refuse)
  NO_PARALLELIZE  the model has no parallelize method
  OWN_TRAIN_STEP  the runner class overrides train_step (which pipeline parallelism never calls)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402  (examples/gpt.py)

from perdure import ParallelRunner  # noqa: E402


class Config(gpt.Config):
    def __init__(self):
        super().__init__()
        self.steps = 12
        self.ckpt.interval = 5
        self.log.interval = 4
        self.dataloader.batch_size = 4
        self.dataloader.drop_last = False  # a resume on more data ranks reads the epoch's tail in shorter batches
        self.sched.warmup_steps = 2
        self.max_grad_norm = 1.0
        self.model.layers = 2
        self.model.dim = 16
        self.model.heads = 2
        self.model.block_size = 8
        self.data.vocab = 32
        self.data.tokens = 572  # 64 training windows: an epoch of 8 steps on 2 data ranks (the runs cross one), 16 on 1


class Indexed(Dataset):
    """The same samples as a mapping that also carries the sample's index (for SAMPLE_LOG)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        inputs, target = self.dataset[index]
        return {"input": inputs, "target": target, "index": index}


class RenamingGPT(gpt.GPT):
    def pipeline_stage(self, stage_index, num_stages):
        stage = super().pipeline_stage(stage_index, num_stages)
        from torch import nn

        stage.layers = nn.ModuleDict({f"stage{stage_index}_{name}": block for name, block in stage.layers.items()})
        return stage


class TestRunner(gpt.GPTRunner):
    def __init__(self, config):
        super().__init__(config)
        if os.environ.get("RENAMING_STAGE"):
            self.model.__class__ = RenamingGPT
        if os.environ.get("NO_PARALLELIZE"):
            self.model.__class__ = type("PlainGPT", (gpt.GPT,), {"parallelize": None})
        if os.environ.get("SAMPLE_LOG"):
            self.datasets["train"] = Indexed(self.datasets["train"])
        self.loss_log = os.environ.get("LOSS_LOG", "").replace("{rank}", str(self.rank)) or None
        self.sample_log = os.environ.get("SAMPLE_LOG", "").replace("{rank}", str(self.rank)) or None
        self.step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
        self.kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
        self.eval_sleep = float(os.environ.get("EVAL_SLEEP", "0"))
        self.eval_log = os.environ.get("EVAL_LOG", "").replace("{rank}", str(self.rank)) or None

    def first_reader(self):
        if not isinstance(self, ParallelRunner):
            return True
        position = self.topology.coordinates(self.rank)
        return position["pipeline"] == 0 and self.topology.stream_leader(self.rank) == self.rank

    def forward_backward(self, window):
        if self.state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sample_log and self.first_reader():
            with open(self.sample_log, "a") as log:
                for batch in window:
                    record = {"epoch": self.state.epoch, "step": self.state.global_step}
                    log.write(json.dumps({**record, "samples": batch["index"].tolist()}) + "\n")
        loss = super().forward_backward(window)
        if self.loss_log:
            with open(self.loss_log, "a") as log:
                record = {"epoch": self.state.epoch, "step": self.state.global_step, "micro": 0}
                log.write(json.dumps({**record, "loss": loss.item().hex()}) + "\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss


class EvalLoggingRunner(TestRunner):
    """With EVAL_SLEEP / EVAL_LOG only: a pipeline refuses a runner that overrides evaluate_step."""

    def evaluate_step(self, batch):
        metrics = super().evaluate_step(batch)
        if self.eval_log:
            with open(self.eval_log, "a") as log:
                log.write(json.dumps({"step": self.state.global_step}) + "\n")
        time.sleep(self.eval_sleep)
        return metrics


class OwnTrainStepRunner(TestRunner):
    def train_step(self, batch):
        inputs, target = self.unpack_batch(batch)
        return self.criterion(self.model(inputs), target) * 2


if __name__ == "__main__":
    runner_class = OwnTrainStepRunner if os.environ.get("OWN_TRAIN_STEP") else TestRunner
    if os.environ.get("EVAL_SLEEP") or os.environ.get("EVAL_LOG"):
        runner_class = EvalLoggingRunner
    runner_class(Config().parse()).train()
