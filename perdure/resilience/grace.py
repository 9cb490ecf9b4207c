"""Grace windows: how long a job has between the stop signal and the SIGKILL, and whether a save fits in it.

A preempted job is stopped with a signal and killed a fixed time later: torchrun sends SIGKILL `--shutdown-timeout`
seconds (default 30) after it forwarded a SIGTERM; SLURM's `--signal=B:USR1@120` comes 120 s before the time limit;
its `KillWait` and Kubernetes' termination grace work the same way. A preemption save longer than that window is
killed half-written, and the rerun resumes from the checkpoint before it. perdure reads the window where the process
can see it and, at the first save, compares it with how long that save took.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT = 30  # torch.distributed.launcher.api: TORCH_ELASTIC_SHUTDOWN_TIMEOUT's default
SLURM_DEFAULT_SIGNAL_LEAD = 60  # sbatch --signal without @sig_time
_SLURM_SIGNAL = re.compile(r"(?:[RB]{1,2}:)?\w+(?:@(\d+))?")
_TORCHRUN_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")
_TORCHRUN_PROGRAMS = ("torchrun", "torch.distributed.run")


@dataclass(frozen=True)
class Grace:
    """A grace window: `seconds` from the stop signal to the SIGKILL, where it was read (`source`) and how to widen it
    (`fix`)."""

    seconds: float
    source: str
    fix: str


def find_grace(configured: float | None, env: Mapping[str, str] | None = None) -> Grace | None:
    """The shortest grace window this process can see: `resilience.grace_s` when set (what the job declares, e.g.
    Kubernetes' `terminationGracePeriodSeconds`); else torchrun's shutdown timeout (under torchrun) and SLURM's signal
    lead (when the job's environment holds `SBATCH_SIGNAL`); None when none is known."""
    if configured is not None:
        return Grace(float(configured), "resilience.grace_s", "widen the launcher's grace and resilience.grace_s")
    env = os.environ if env is None else env
    found = [grace for grace in (_torchrun_grace(env), _slurm_grace(env)) if grace is not None]
    return min(found, key=lambda grace: grace.seconds) if found else None


def _torchrun_grace(env: Mapping[str, str]) -> Grace | None:
    """torchrun's `--shutdown-timeout`, as torchrun itself resolves it: its command line (the parent of a rank), else
    PET_SHUTDOWN_TIMEOUT, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s."""
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    fix = "start torchrun with a longer --shutdown-timeout (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"
    flag = _launcher_flag(launcher_command())
    if flag is not None:
        return Grace(flag, f"torchrun's --shutdown-timeout {flag:g}", fix)
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        seconds = _seconds(env.get(name))
        if seconds is not None:
            return Grace(seconds, f"torchrun's shutdown timeout, {name}={env[name]}", fix)
    seconds = TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT
    return Grace(seconds, f"torchrun's shutdown timeout, its default of {seconds} s", fix)


def _slurm_grace(env: Mapping[str, str]) -> Grace | None:
    """The lead of SLURM's `--signal=[R|B:]SIG[@seconds]` (60 s without `@`), when the job's environment says it
    (`SBATCH_SIGNAL`, which sbatch reads as `--signal` and the job inherits)."""
    spec = env.get("SBATCH_SIGNAL")
    if not env.get("SLURM_JOB_ID") or not spec:
        return None
    match = _SLURM_SIGNAL.fullmatch(spec.strip())
    if match is None:
        return None
    seconds = float(match.group(1)) if match.group(1) else SLURM_DEFAULT_SIGNAL_LEAD
    return Grace(
        seconds, f"SLURM's signal lead, SBATCH_SIGNAL={spec}", "ask for the signal earlier (--signal=B:USR1@S)"
    )


def launcher_command() -> list[str]:
    """The command line of this process's parent (under torchrun: the agent that started this rank); empty where it
    cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _launcher_flag(command: list[str]) -> float | None:
    """`--shutdown-timeout N` (or `=N`) on a torchrun command line; None on any other command."""
    if not any(part.endswith(_TORCHRUN_PROGRAMS) for part in command[:3]):
        return None
    for index, part in enumerate(command):
        name, equals, value = part.partition("=")
        if name in _TORCHRUN_FLAGS:
            return _seconds(value if equals else (command[index + 1] if index + 1 < len(command) else None))
    return None


def _seconds(text: str | None) -> float | None:
    try:
        seconds = float(text) if text is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


class GraceCheck:
    """Compares the first save of an attempt with the grace window, once: INFO when it fits, WARNING when not."""

    def __init__(self, grace: Grace | None, logger: logging.Logger) -> None:
        self.grace = grace
        self.logger = logger
        self.checked = False

    def saved(self, seconds: float) -> None:
        """A save took `seconds` (the loop's time for a synchronous one, the writer's for a background one)."""
        if self.checked or self.grace is None:
            return
        self.checked = True
        grace = self.grace
        if seconds <= grace.seconds:
            self.logger.info("grace window %gs (%s); the first save took %.2fs", grace.seconds, grace.source, seconds)
            return
        self.logger.warning(
            "the first save took %.1fs, longer than the %gs grace window (%s): a preemption save would be killed "
            "half-written by the SIGKILL that follows the stop signal, and the rerun would resume from the checkpoint "
            "before it. %s, or make saves faster",
            seconds, grace.seconds, grace.source, grace.fix[0].upper() + grace.fix[1:],
        )  # fmt: skip
