"""Cadence: when the loop logs, evaluates and saves, read from the config once per `train()`."""

from __future__ import annotations

from dataclasses import dataclass

from perdure.checkpoints.auto_interval import AUTO
from perdure.config import RunnerConfig

DEFAULT_STEP_INTERVAL = 500


@dataclass(frozen=True)
class Cadence:
    """Intervals in optimizer steps (step mode) or epochs (epoch mode, except `save_every_steps`)."""

    by_epoch: bool
    log_every: int
    eval_every: int
    save_every: int
    save_every_steps: int | None  # extra mid-epoch saves in epoch mode
    save_best: bool

    @classmethod
    def from_config(cls, config: RunnerConfig) -> Cadence:
        by_epoch = config.training_mode() == "epochs"
        default = 1 if by_epoch else DEFAULT_STEP_INTERVAL
        interval = config.ckpt.interval  # `auto`: perdure.runners.save_schedule decides; evaluations keep the default
        save_every = default if interval in (None, AUTO) else interval
        return cls(
            by_epoch=by_epoch,
            log_every=config.log.interval,
            # step mode: evaluate where checkpoints are taken unless told otherwise (a best found between two saves
            # is saved too, see `_evaluate_and_save`); epoch mode: after every epoch
            eval_every=config.eval.interval or (1 if by_epoch else save_every),
            save_every=save_every,
            save_every_steps=config.ckpt.interval_steps if by_epoch else None,
            save_best=bool(config.ckpt.save_best),
        )
