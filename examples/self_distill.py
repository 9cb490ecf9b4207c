"""Self-distillation with a momentum teacher (in the manner of BYOL / DINO): state of your own in every checkpoint.

    python examples/self_distill.py                 # 200 steps, a checkpoint every 50, a few seconds on a CPU
    python examples/self_distill.py --steps 300     # extend the same run: teacher and student continue together

The student learns to match a teacher that is not trained: after every optimizer step the teacher moves a little
towards the student (an exponential moving average), and a running centre of its outputs keeps it from collapsing.
The teacher is state of the program's own, which perdure knows nothing about: `self.checkpointed["teacher"]` puts it
in every checkpoint and restores it on resume, so a run killed at any instant and run again ends with the same
student and the same teacher, bit for bit, as one that never stopped. At the end the teacher, the model one keeps in
this method, is written to `teacher.pth` in the run directory.

Environment knob (for tests only, it does not change the maths or the run's identity):
  DISTILL_STEP_DELAY  seconds to sleep after each micro-batch, so that a kill lands mid-run
"""

import copy
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from perdure import Runner, RunnerConfig


class Config(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 200
        self.seed = 1337
        self.ckpt.interval = 50
        self.optim.lr = 1e-3
        self.dataloader.batch_size = 64
        self.teacher.momentum = 0.99  # how much of itself the teacher keeps at each step
        self.teacher.temperature = 0.04  # sharpness of the teacher's targets
        self.teacher.center_momentum = 0.9  # how slowly the centre of the teacher's outputs moves
        self.student.temperature = 0.1
        self.net.features = 32
        self.net.hidden = 128
        self.net.outputs = 64


class Teacher:
    """The momentum teacher: a copy of the student that follows it, and the running centre of its outputs."""

    def __init__(self, student: nn.Module, outputs: int):
        self.net = copy.deepcopy(student).requires_grad_(False)
        self.center = torch.zeros(outputs)

    def to(self, device: torch.device) -> "Teacher":
        self.net.to(device)
        self.center = self.center.to(device)
        return self

    @torch.no_grad()
    def follow(self, student: nn.Module, momentum: float) -> None:
        for mine, theirs in zip(self.net.parameters(), student.parameters()):
            mine.lerp_(theirs, 1 - momentum)

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "center": self.center}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.center.copy_(state["center"])


class SelfDistillRunner(Runner):
    model: nn.Sequential

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        net = config.net
        g = torch.Generator().manual_seed(0)  # the data never depends on the run's seed
        inputs = torch.randn(4096, net.features, generator=g) @ torch.randn(net.features, net.features, generator=g)
        self.datasets["train"] = TensorDataset(inputs)
        self.model = nn.Sequential(nn.Linear(net.features, net.hidden), nn.GELU(), nn.Linear(net.hidden, net.outputs))
        self.teacher = Teacher(self.model, net.outputs).to(self.device)  # the student is moved there after __init__
        self.checkpointed["teacher"] = self.teacher  # saved and restored with the run, after its own state
        self.step_delay = float(os.environ.get("DISTILL_STEP_DELAY", "0"))

    def train_step(self, batch: Any) -> torch.Tensor:
        (x,) = self.to_device(batch)
        # Two random views of each sample (global generators: perdure restores them on resume).
        view_teacher = x + 0.1 * torch.randn_like(x)
        view_student = x * (torch.rand_like(x) > 0.2)
        with torch.no_grad():
            teacher_out = self.teacher.net(view_teacher)
            targets = torch.softmax((teacher_out - self.teacher.center) / self.config.teacher.temperature, dim=-1)
            self.batch_center = teacher_out.mean(dim=0)
        log_probs = torch.log_softmax(self.model(view_student) / self.config.student.temperature, dim=-1)
        if self.step_delay:
            time.sleep(self.step_delay)
        return -(targets * log_probs).sum(dim=-1).mean()

    def optimizer_step(self) -> bool:
        # Called once per optimizer step; the teacher follows only a step that was taken (not a skipped one).
        stepped = super().optimizer_step()
        if stepped:
            self.teacher.follow(self.unwrap_model(), self.config.teacher.momentum)
            self.teacher.center.lerp_(self.batch_center, 1 - self.config.teacher.center_momentum)
        return stepped


if __name__ == "__main__":
    runner = SelfDistillRunner(Config().parse())
    runner.train()
    if runner.is_main_process and runner.config.ckpt.enabled:
        torch.save(runner.teacher.net.state_dict(), runner.run_dir.path / "teacher.pth")
