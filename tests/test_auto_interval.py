"""`ckpt.interval auto`: Young/Daly's sqrt(2 x stall x MTBF), clamped, in steps; the config keys' checks; a run
that saves where the schedule it logged said."""

from __future__ import annotations

import math
import re

import pytest

from perdure import ConfigError
from perdure.checkpoints.auto_interval import FIRST_AUTO_STEPS, choose_interval, young_daly_seconds
from perdure.workspace.sidecar import read_sidecar
from tests.scripts.resumable import ResumableRunner, make_config


def test_the_interval_is_the_formulas_value_in_steps():
    choice = choose_interval(stall_s=2.0, mtbf_s=3600.0, step_time_s=0.5)
    assert choice.seconds == young_daly_seconds(2.0, 3600.0) == math.sqrt(2 * 2.0 * 3600.0) == 120.0
    assert choice.steps == 240 and choice.clamp is None
    assert "240 steps" in choice.describe() and "MTBF 3.6e+03 s" in choice.describe()


def test_the_clamps():
    often = choose_interval(stall_s=10.0, mtbf_s=100.0, step_time_s=1.0)  # formula 44.7 s < 10 x stall
    assert (often.seconds, often.steps, often.clamp) == (100.0, 100, "10 x stall")
    rare = choose_interval(stall_s=30.0, mtbf_s=240.0, step_time_s=1.0)  # formula 120 s = MTBF / 2, both bounds cross
    assert rare.seconds == 300.0 and rare.clamp == "10 x stall"  # the lower bound wins
    half = choose_interval(stall_s=1.0, mtbf_s=6.0, step_time_s=0.1)  # formula 3.46 s > MTBF / 2 = 3 s ...
    assert half.seconds == 10.0 and half.clamp == "10 x stall"  # ... and 10 x stall above both
    capped = choose_interval(stall_s=0.001, mtbf_s=50.0, step_time_s=0.01)  # formula 0.316 s, MTBF / 2 = 25 s
    assert capped.steps == 32 and capped.clamp is None
    assert choose_interval(stall_s=1.0, mtbf_s=1e9, step_time_s=1e-9).steps == 1_000_000
    assert choose_interval(stall_s=0.01, mtbf_s=1.0, step_time_s=10.0).steps == 1
    with pytest.raises(ValueError):
        choose_interval(stall_s=0.0, mtbf_s=1.0, step_time_s=1.0)


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"ckpt.interval": "often"}, "ckpt.interval"),
        ({"ckpt.interval": 0}, "ckpt.interval"),
        ({"ckpt.interval": "auto", "steps": None, "epochs": 2}, "ckpt.interval"),
        ({"ckpt.interval": "auto", "ckpt.mtbf": 0}, "ckpt.mtbf"),
        ({"ckpt.interval": "auto", "ckpt.mtbf": "daily"}, "ckpt.mtbf"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path, settings, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        make_config(tmp_path, **{"steps": 10, **settings}).check()


def test_auto_saves_where_its_logged_schedule_says(tmp_path):
    # no evaluation but the final one: a new best score would be saved too (evaluations are every 500 steps)
    settings = {"ckpt.interval": "auto", "ckpt.mtbf": 1.0, "ckpt.keep_latest_k": 0, "eval.interval": 100_000}
    config = make_config(tmp_path, steps=320, **settings)
    make_config(tmp_path, steps=10, **{"ckpt.interval": "auto"}).check()  # accepted in step mode
    runner = ResumableRunner(config)
    runner.train()
    saved = sorted(int(path.name[len("ckpt-s") :]) for path in runner.run_dir.checkpoints.glob("ckpt-s*"))
    assert saved[:2] == [FIRST_AUTO_STEPS, 2 * FIRST_AUTO_STEPS]  # nothing measured before the first save
    (log,) = (runner.run_dir.path / "logs").glob("*.log")
    chosen = re.findall(r"checkpoint interval \(ckpt.interval auto\): (\d+) steps \(.*MTBF 1 s\)", log.read_text())
    assert chosen, log.read_text()
    following = 2 * FIRST_AUTO_STEPS + int(chosen[0])
    assert saved[2] == min(following, 320)
    # each decision is stored in its checkpoint's state with its input: the mean stall of the saves before it (the
    # save at 100 for the decision at 200; one more for each later decision, the one at 320 too when it was due)
    before = len([step for step in saved if step < 320])
    assert runner.state.save_stalls in (before - 1, before) and runner.state.save_stall_s > 0

    # resumed (the budget extended), the run saves next where the checkpoint it resumed from planned, not earlier
    planned = runner.state.auto_save_step
    assert planned > 320
    # without ckpt.mtbf this time: the MTBF is the run's own, its attempts' wall time over one interruption at least
    settings.pop("ckpt.mtbf")
    resumed = ResumableRunner(make_config(tmp_path, steps=planned + 1, **settings))
    assert resumed.state.global_step == 320 and resumed.state.auto_save_step == planned
    resumed.train()
    after = sorted(int(path.name[len("ckpt-s") :]) for path in resumed.run_dir.checkpoints.glob("ckpt-s*"))
    assert [step for step in after if step > 320] == [planned, planned + 1]
    first = read_sidecar(resumed.run_dir.path / "sidecar.json")["attempts"][0]
    assert resumed.telemetry.run_mtbf() > sum(first["goodput"]["seconds"].values()) > 0
    if planned - 320 >= 2:  # a step time measured before the plan at `planned`
        (_, log) = sorted((resumed.run_dir.path / "logs").glob("*.log"))
        assert "MTBF measured from the run's attempts" in log.read_text()


def test_auto_on_the_command_line_over_a_programs_number(tmp_path):
    config = make_config(tmp_path, steps=10, **{"ckpt.interval": 50}).parse(["--ckpt.interval", "auto"])
    assert config.ckpt.interval == "auto"
    assert make_config(tmp_path, steps=10).parse(["--ckpt.interval", "20"]).ckpt.interval == 20
