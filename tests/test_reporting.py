"""What a run tells people: its budget in `perdure runs show`, and counts in words ("1 rank", "2 ranks")."""

from __future__ import annotations

import json

from perdure.cli.main import main as perdure_cli
from perdure.wording import counted
from tests.scripts.resumable import ResumableRunner, make_config


def test_runs_show_includes_the_budget_each_attempt_ran_with(tmp_path, capsys):
    ResumableRunner(make_config(tmp_path, steps=4, **{"ckpt.interval": 2})).train()
    runner = ResumableRunner(make_config(tmp_path, steps=6, **{"ckpt.interval": 2}))  # extended: a second attempt
    runner.train()
    attempts = json.loads((runner.run_dir.path / "sidecar.json").read_text())["attempts"]
    assert [attempt["budget"] for attempt in attempts] == [{"steps": 4}, {"steps": 6}]
    capsys.readouterr()
    assert perdure_cli(["runs", "show", runner.run_dir.run_id, "--root", str(tmp_path)]) == 0
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.split("\n\n")[0].splitlines())
    assert fields["budget"] == "6 steps" and fields["step"] == "6"
    epochs = ResumableRunner(make_config(tmp_path / "epochs", steps=None, epochs=1))
    epochs.train()
    capsys.readouterr()
    assert perdure_cli(["runs", "show", epochs.run_dir.run_id, "--root", str(tmp_path / "epochs")]) == 0
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.split("\n\n")[0].splitlines())
    assert fields["budget"] == "1 epoch"


def test_counts_in_words():
    assert counted(1, "rank") == "1 rank" and counted(2, "rank") == "2 ranks" and counted(0, "rank") == "0 ranks"
    assert counted(None, "rank") == "? ranks" and counted(True, "rank") == "True ranks"
