"""Shared runs of the DeepSpeed tests: one uninterrupted reference and one killed run per configuration.

Every configuration trains `resumable.py` on 2 gloo ranks for 14 steps (48 samples, 4 per rank: 6 steps an epoch, so a
resume from step 5 or 10 crosses an epoch boundary) with checkpoints at steps 5 and 10. The killed run SIGKILLs every
rank at step 12; tests copy it before rerunning it. Engine start-up costs a few seconds per launch: launches are few.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.runs import assert_all_ok, run_ranks

ARGS = ("--stack", "deepspeed", "--steps", "14", "--ckpt.interval", "5", "--dist.timeout", "60")
ARGS += ("--dataset_size", "48", "--dataloader.batch_size", "4", "--log.interval", "1")
TIMEOUT = 150  # seconds one launch of the ranks may take before the test fails

# ZeRO-1 in bf16 with accumulation; ZeRO-2 and ZeRO-3 in fp32, ZeRO-3 with EMA (its update gathers the partitions).
CONFIGS = {
    "zero1-bf16-accum": ("--deepspeed.zero_stage", "1", "--precision", "bf16", "--accum_steps", "2", "--steps", "8",
                         "--ckpt.interval", "4"),
    "zero2": ("--deepspeed.zero_stage", "2"),
    "zero3-ema": ("--deepspeed.zero_stage", "3", "--ema.enabled", "true"),
}  # fmt: skip
KILL_AT = {"zero1-bf16-accum": "7", "zero2": "12", "zero3-ema": "12"}


def args_of(config: str) -> tuple[str, ...]:
    return (*ARGS, *CONFIGS[config])


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs, made when a test first asks for one (`reference(config)`)."""
    made: dict[str, Path] = {}

    def reference(config: str) -> Path:
        if config not in made:
            root = tmp_path_factory.mktemp(f"reference-{config}")
            env = {"LOSS_LOG": root / "losses-{rank}.jsonl", "GATHERED_WEIGHTS": root / "gathered.pth"}
            assert_all_ok(run_ranks(2, "resumable.py", root, *args_of(config), timeout=TIMEOUT, **env))
            made[config] = root
        return made[config]

    return reference


@pytest.fixture(scope="session")
def killed(tmp_path_factory: pytest.TempPathFactory):
    """A private copy of a run whose every rank was SIGKILLed (at step 12; ZeRO-1: 7), made once per config."""
    made: dict[str, Path] = {}

    def copy(config: str, target: Path) -> Path:
        if config not in made:
            root = tmp_path_factory.mktemp(f"killed-{config}") / "runs"
            kill = KILL_AT[config]
            results = run_ranks(2, "resumable.py", root, *args_of(config), timeout=TIMEOUT, KILL_AT_STEP=kill)
            assert [r.returncode for r in results] == [-signal.SIGKILL] * 2, [r.stdout for r in results]
            made[config] = root
        shutil.copytree(made[config], target, symlinks=True)
        return target

    return copy
