"""The training program of the sweep tests: tests/scripts/resumable.py's runner, plus two knobs.

LOSS_LOG      as in resumable.py; "{job}" in the path is replaced by the sweep's job id ($PERDURE_SWEEP_JOB)
TERM_MARKERS  a directory: under a sweep, the job whose config sets `term_at_step` sends itself SIGTERM when it
              reaches that step, once (a marker file there remembers it), so it saves and exits 143 as if
              preempted. Outside a sweep (no $PERDURE_SWEEP_JOB) it never does: that is the uninterrupted run.
"""

import os
import signal
from pathlib import Path

from resumable import Config, ResumableRunner


class SweepConfig(Config):
    def __init__(self):
        super().__init__()
        self.term_at_step = -1


class SweepJobRunner(ResumableRunner):
    def __init__(self, config):
        super().__init__(config)
        job = os.environ.get("PERDURE_SWEEP_JOB")
        if self.loss_log:
            self.loss_log = self.loss_log.replace("{job}", job or "none")
        markers = os.environ.get("TERM_MARKERS")
        self.term_marker = Path(markers) / f"{job}.term" if markers and job else None

    def train_step(self, batch):
        marker = self.term_marker
        if marker is not None and self.state.global_step == self.config.term_at_step and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(batch)


if __name__ == "__main__":
    SweepJobRunner(SweepConfig().parse()).train()
