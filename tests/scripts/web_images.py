"""tests/scripts/resumable.py plus images and a deliberate crash: the web viewer's tests launch it.

Environment knobs (tests only):
  IMAGE_EVERY   log two images every N optimizer steps (default 0: none):
                  samples/pattern  a 24x24 RGB picture that visibly moves with the step
                  weights/layer0   the first layer's weights, scaled to [0, 1] (a real picture of training)
  FAIL_AT_STEP  raise RuntimeError when `global_step` reaches this value (a program that crashes: status failed)
"""

import os

import torch

from tests.scripts.resumable import Config, ResumableRunner


def pattern(step: int, size: int = 24) -> torch.Tensor:
    """A CHW float picture: a colour gradient and a bright square whose position follows the step."""
    ys, xs = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    image = torch.stack([xs, ys, torch.full_like(xs, (step % 7) / 7)])
    corner = (3 * step) % (size - 6)
    image[:, corner : corner + 6, corner : corner + 6] = 1.0
    return image


class ImageRunner(ResumableRunner):
    def __init__(self, config):
        super().__init__(config)
        self.image_every = int(os.environ.get("IMAGE_EVERY", "0"))
        self.fail_at = int(os.environ.get("FAIL_AT_STEP", "-1"))

    def train_step(self, batch):
        step = self.state.global_step
        if step == self.fail_at:
            raise RuntimeError(f"deliberate failure at step {step} (FAIL_AT_STEP)")
        if self.image_every and step % self.image_every == 0:
            self.log_image("samples/pattern", pattern(step))
            weights = self.model[0].weight.detach()
            self.log_image("weights/layer0", (weights - weights.min()) / (weights.max() - weights.min() + 1e-12))
        return super().train_step(batch)


if __name__ == "__main__":
    ImageRunner(Config().parse()).train()
