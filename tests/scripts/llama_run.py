"""examples/llama.py as tests launch it, tiny.

Environment knobs (tests only):
  KILL_AT_STEP    SIGKILL this very process when `global_step` reaches this value (every rank at the same step)
  MESH_DIM        parallelize_model asks the mesh for this dimension (a name TorchTitan's mesh does not have)
  PARALLEL_DIMS   parallelize_model treats the mesh as TorchTitan's ParallelDims (`mesh.tp_enabled`)
  SHARDED_LOGITS  the TP plan leaves the logits sharded whatever parallel.loss_parallel says
  NO_VAL          no validation split (a compiled model compiles its evaluation graphs too: time)
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama  # noqa: E402  (examples/llama.py)


class Config(llama.Config):
    def __init__(self):
        super().__init__()
        self.steps = 10
        self.ckpt.interval = 5
        self.log.interval = 2
        self.dataloader.batch_size = 4
        self.model.dim = 16
        self.model.heads = 2
        self.model.hidden = 32
        self.model.seq_len = 8
        self.model.vocab = 32
        self.data.tokens = 700  # 87 windows: an epoch of 10 steps on 2 data ranks (the runs cross one)


class TestRunner(llama.LlamaRunner):
    def __init__(self, config):
        super().__init__(config)
        if os.environ.get("NO_VAL"):
            del self.datasets["val"]

    def parallelize_model(self, model, mesh):
        if os.environ.get("MESH_DIM"):
            print(mesh[os.environ["MESH_DIM"]])
        if os.environ.get("PARALLEL_DIMS"):
            print(mesh.tp_enabled)
        if os.environ.get("SHARDED_LOGITS"):
            llama.apply_tp(model, mesh["tp"], loss_parallel=True)
            return
        super().parallelize_model(model, mesh)

    def forward_backward(self, window):
        if self.state.global_step == int(os.environ.get("KILL_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward_backward(window)


if __name__ == "__main__":
    TestRunner(Config().parse()).train()
