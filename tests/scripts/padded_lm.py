"""examples/padded_lm.py as the token-weighted loss tests launch it. KILL_AT_STEP: SIGKILL this very process when
`global_step` reaches this value (every rank at the same step)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import padded_lm  # noqa: E402  (examples/padded_lm.py)


class TestRunner(padded_lm.LMRunner):
    def forward_backward(self, window):
        if self.state.global_step == int(os.environ.get("KILL_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward_backward(window)


if __name__ == "__main__":
    TestRunner(padded_lm.Config().parse()).train()
