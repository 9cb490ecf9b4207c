"""The tiny GPT of parallel_gpt.py with its blocks wrapped in torch's `checkpoint_wrapper`, on any stack.

Environment knobs (tests only):
  WRAP_BLOCKS         `user`: the program wraps every block (TorchTitan's `apply_ac`: the wrapper replaces the block
                      in `layers`, which renames its parameters) in `__init__`, after building the optimizer, before
                      perdure sees the model; `override`: the runner's `apply_activation_checkpointing` does it, after
                      the parallel stack read the parameters
  INITIAL_WEIGHTS     save the model's weights there when `__init__` ends (rank 0)
  PARTIAL_OPTIMIZER   the optimizer holds the head only: the blocks have requires_grad and no optimizer
"""

import os
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import parallel_gpt  # noqa: E402  (tests/scripts/parallel_gpt.py)

gpt = parallel_gpt.gpt


def wrap_blocks(model):
    """TorchTitan's `apply_ac`: each block of `model.layers` replaced by its checkpoint wrapper."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True))


class Config(parallel_gpt.Config):
    def __init__(self):
        super().__init__()
        self.steps = 3
        self.ckpt.interval = None
        self.max_grad_norm = 0.0
        self.sched.warmup_steps = 0


class WrappedRunner(gpt.GPTRunner):
    def __init__(self, config):
        super().__init__(config)
        if os.environ.get("PARTIAL_OPTIMIZER"):
            self.optimizer = torch.optim.AdamW(self.model.head.parameters(), lr=config.optim.lr)
        if os.environ.get("WRAP_BLOCKS") == "user":
            wrap_blocks(self.model)
        if os.environ.get("INITIAL_WEIGHTS") and self.rank == 0:
            torch.save({key: value.clone() for key, value in self.model.state_dict().items()},
                       os.environ["INITIAL_WEIGHTS"])  # fmt: skip

    def apply_activation_checkpointing(self, model):
        """The user's own activation checkpointing, as TorchTitan applies it (the parallel stack calls it)."""
        if os.environ.get("WRAP_BLOCKS") == "override":
            wrap_blocks(model)
        else:
            super().apply_activation_checkpointing(model)


if __name__ == "__main__":
    WrappedRunner(Config().parse()).train()
