"""Weights & Biases: one W&B run per perdure run, continued across resumes through the id the checkpoint carries."""

from __future__ import annotations

import importlib.util
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from perdure.errors import ConfigError
from perdure.loggers.base import MetricLogger, metric_tag
from perdure.loggers.console import get_logger
from perdure.loggers.images import to_image_array
from perdure.safe_io import ensure_dir

if TYPE_CHECKING:
    from perdure.config import RunnerConfig
    from perdure.runners.state import RunnerState


_ID_CHARS = string.ascii_lowercase + string.digits


def generate_run_id(length: int = 8) -> str:
    """A fresh W&B run id: base-36, like W&B's own, from `secrets` so a seeded `random` never repeats one."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(length))


class WandbLogger(MetricLogger):
    """Logs `split/name` scalars and images to W&B with `step=` the global step.

    `open` reuses `state.wandb_run_id` when the restored checkpoint carries one, else generates an id and stores it
    in `state`, so the next checkpoint carries it and every later attempt continues the same W&B run
    (`resume="allow"`). The run gets `config` = the canonical hparams, `name` = the run directory's id, `group` = its
    `<lineage>-<code_id>` folder, `tags` = `workspace.tags`, and writes under `<run dir>/wandb/`.

    A resumed attempt logs again the steps between the checkpoint and the point the dead attempt reached. W&B keeps a
    run's steps strictly increasing: online, a resumed run starts after the last step the server holds and W&B would
    warn about, then drop, each earlier step; this logger drops those steps itself, silently (for a bit-exact resume
    they hold the same values). Offline, each attempt is a separate `offline-run-*` directory under the same id,
    to be synced in order. With `rewind=True` (W&B's beta run rewind, `resume_from="<id>?_step=<step>"`, a feature
    the W&B account must have), the server truncates the run's history to the checkpoint's step instead.

    The W&B run is created with `reinit="create_new"`: it never finishes or hijacks a run the user opened; the
    user's own code reaches it through `WandbLogger.run`.
    """

    def __init__(self, rewind: bool = False) -> None:
        self.rewind = rewind
        self.run: Any = None
        self._first_step = 0  # the run's first step: lower ones are already on the W&B server
        self._last_step = 0  # W&B refuses a step below the last one logged
        self._warned_images = False
        self._warned_order = False

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("wandb.enabled", True, "the 'wandb' package is not installed; pip install wandb")
        import wandb

        from perdure.workspace.identity import canonical_config

        run_dir = Path(run_dir)
        ensure_dir(run_dir / "wandb")  # W&B writes there: never through a symlink to somewhere else
        resumed = state.wandb_run_id is not None
        if not resumed:
            state.wandb_run_id = generate_run_id()
        if self.rewind and resumed and resumed_step > 0:
            where: dict[str, Any] = {"resume_from": f"{state.wandb_run_id}?_step={resumed_step}"}
        else:
            where = {"id": state.wandb_run_id, "resume": "allow"}
        self.run = wandb.init(
            project=config.lookup("wandb.project"),
            entity=config.lookup("wandb.entity"),
            mode=config.lookup("wandb.mode", "online"),
            dir=str(run_dir),
            name=run_dir.name,
            group=run_dir.parent.name or None,
            tags=list(config.lookup("workspace.tags") or []) or None,
            config=canonical_config(config),
            reinit="create_new",
            **where,
        )
        self._first_step = self._last_step = int(getattr(self.run, "starting_step", 0) or 0)
        if self._first_step > resumed_step + 1:
            get_logger().info(
                "wandb: run %s already holds steps up to %d; steps %d..%d logged again by this resume are skipped",
                state.wandb_run_id,
                self._first_step - 1,
                resumed_step + 1,
                self._first_step - 1,
            )

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        self._log({metric_tag(split, name): float(value) for name, value in metrics.items()}, step)

    def log_image(self, tag: str, image: np.ndarray, step: int, index: int = 0) -> None:
        if importlib.util.find_spec("PIL") is None:
            if not self._warned_images:
                get_logger().warning("wandb: images need the 'pillow' package (pip install pillow); not sent to W&B")
                self._warned_images = True
            return
        import wandb

        array = to_image_array(image)
        name = tag if index == 0 else f"{tag}_{index}"
        self._log({name: wandb.Image(array[:, :, 0] if array.shape[2] == 1 else array)}, step)

    def close(self, exit_code: int | None = None) -> None:
        """Finish the W&B run; a non-zero `exit_code` marks it failed in W&B. Idempotent."""
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None:
            raise RuntimeError("WandbLogger used before open()")
        step = int(step)
        if step < self._first_step:
            return  # the server already holds this step (see the class docstring); W&B would warn and drop it
        if step < self._last_step:
            if not self._warned_order:
                get_logger().warning(
                    "wandb: step %d logged after step %d; W&B needs increasing steps, so it is skipped "
                    "(further out-of-order steps are skipped silently)",
                    step,
                    self._last_step,
                )
                self._warned_order = True
            return
        self.run.log(data, step=step)
        self._last_step = step
