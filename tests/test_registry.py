"""The run registry (`perdure.registry`, `perdure runs ...`): a cache of sidecars that can always be rebuilt."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import pytest

from perdure import registry as public
from perdure.cli.main import main
from perdure.errors import PerdureError
from perdure.workspace.heartbeat import HEARTBEAT_NAME
from perdure.workspace.registry import (
    REGISTRY_NAME,
    AmbiguousRunError,
    Registry,
    RegistryError,
    RunNotFoundError,
)
from perdure.workspace.run_dir import ROOT_ENV
from perdure.workspace.sidecar import SIDECAR_NAME, Sidecar, utc_stamp


def make_run(
    root: Path,
    config_id: str,
    *,
    lineage: str = "mlp",
    code_id: str = "abc1234",
    val_losses: tuple[float, ...] = (1.0,),
    accuracy: float | None = None,
    status: str = "completed",
    tags: tuple[str, ...] = (),
) -> Path:
    """A run dir holding a sidecar as the runner would leave it (one attempt, a val/loss per 10 steps)."""
    run_id = f"{code_id}-{config_id}"
    run_dir = root / f"{lineage}-{code_id}" / run_id
    sidecar = Sidecar(
        run_dir,
        run_id=run_id,
        lineage=lineage,
        code_id=code_id,
        config_id=config_id,
        hparams={"optim": {"lr": 0.001}, "score": {"split": "val", "metric": "loss"}},
        tags=list(tags),
    )
    sidecar.start_attempt(started=utc_stamp(), restart_counts={}, resumed_from=None, resumed_step=0)
    for index, loss in enumerate(val_losses, start=1):
        metrics = {"train": {"loss": loss * 2}, "val": {"loss": loss}}
        if accuracy is not None:
            metrics["val"]["acc"] = accuracy
        sidecar.record(step=index * 10, metrics=metrics, latest_checkpoint=f"ckpt-s{index * 10:012d}")
    if status != "running":
        sidecar.finish_attempt(status, "test")
    sidecar.write()
    return run_dir


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["runs", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    make_run(root, "aaaaaaaaaaaa", val_losses=(0.9, 0.5, 0.7), accuracy=0.70, tags=("baseline",))
    make_run(root, "bbbbbbbbbbbb", val_losses=(0.8, 0.3), accuracy=0.60, status="failed")
    make_run(root, "cccccccccccc", lineage="cnn", val_losses=(0.6,), accuracy=0.95, status="running")
    return root


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_ENV, raising=False)


# ---------------------------------------------------------------------- the cache


def test_deleting_the_db_gives_the_same_listing(root: Path, capsys):
    code, before, _ = cli(capsys, "ls", "--root", str(root))
    assert code == 0 and (root / REGISTRY_NAME).exists()
    (root / REGISTRY_NAME).unlink()
    code, after, _ = cli(capsys, "ls", "--root", str(root))
    assert code == 0 and after == before
    assert cli(capsys, "scan", "--root", str(root))[1].startswith("3 run(s)")
    (root / REGISTRY_NAME).unlink()
    assert cli(capsys, "scan", "--root", str(root))[0] == 0
    assert cli(capsys, "ls", "--root", str(root))[1] == before
    best_before = cli(capsys, "best", "val/loss", "--root", str(root))[1]
    (root / REGISTRY_NAME).unlink()
    assert cli(capsys, "best", "val/loss", "--root", str(root))[1] == best_before


def test_a_corrupt_db_is_rebuilt(root: Path):
    with Registry(root) as registry:
        expected = [r.run_id for r in registry.runs()]
    (root / REGISTRY_NAME).write_bytes(b"this is not a database" * 100)
    with Registry(root) as registry:
        assert [r.run_id for r in registry.runs()] == expected


def test_incremental_scan(root: Path):
    with Registry(root) as registry:
        first = registry.scan()
        assert (first.found, first.updated, first.removed, first.errors) == (3, 3, 0, [])
        again = registry.scan()
        assert (again.found, again.updated, again.removed) == (3, 0, 0)
        make_run(root, "aaaaaaaaaaaa", val_losses=(0.9, 0.5, 0.7, 0.1), accuracy=0.7)  # the run logged more
        changed = registry.scan()
        assert changed.updated == 1
        assert registry.get("abc1234-aaaa").metric("val/loss", "min") == 0.1
        make_run(root, "dddddddddddd")
        assert registry.scan().updated == 1
        os.remove(root / "mlp-abc1234" / "abc1234-bbbbbbbbbbbb" / SIDECAR_NAME)
        removed = registry.scan()
        assert (removed.found, removed.updated, removed.removed) == (3, 0, 1)
        assert registry.scan(full=True).updated == 3
        assert "abc1234-bbbbbbbbbbbb" not in [r.run_id for r in registry.runs()]


def test_two_registries_share_the_cache(root: Path):
    with Registry(root) as one, Registry(root) as two:
        assert one.scan().updated == 3
        assert two.scan().updated == 0
        assert [r.run_id for r in one.runs()] == [r.run_id for r in two.runs()]


# ---------------------------------------------------------------------- queries


def test_runs_order_and_fields(root: Path):
    records = Registry(root).runs()
    assert [r.run_id for r in records] == ["abc1234-cccccccccccc", "abc1234-bbbbbbbbbbbb", "abc1234-aaaaaaaaaaaa"]
    first = records[-1]
    assert first.lineage == "mlp" and first.code_id == "abc1234" and first.config_id == "aaaaaaaaaaaa"
    assert first.path == root / "mlp-abc1234" / "abc1234-aaaaaaaaaaaa"
    assert first.status == "completed" and first.tags == ["baseline"] and first.attempts == 1 and first.step == 30
    assert first.hparams["optim"]["lr"] == 0.001
    assert first.summary["val/loss"]["min"] == 0.5 and first.summary["val/loss"]["latest"] == 0.7
    assert first.latest_checkpoint == "ckpt-s000000000030"
    assert first.created <= first.updated


def test_filters(root: Path):
    registry = Registry(root)
    assert [r.config_id for r in registry.runs(lineage="cnn")] == ["cccccccccccc"]
    assert [r.config_id for r in registry.runs(status="failed")] == ["bbbbbbbbbbbb"]
    assert [r.config_id for r in registry.runs(tag="baseline")] == ["aaaaaaaaaaaa"]
    assert registry.runs(lineage="mlp", status="running") == []
    with pytest.raises(RegistryError, match="completed"):
        registry.runs(status="finished")


def test_status_completed_failed_running_and_stale(root: Path):
    registry = Registry(root, stale_after=600)
    assert {r.config_id: r.status for r in registry.runs()} == {
        "aaaaaaaaaaaa": "completed",
        "bbbbbbbbbbbb": "failed",
        "cccccccccccc": "running",
    }
    old = time.time() - 3600
    for run in root.glob("*/*"):
        os.utime(run / HEARTBEAT_NAME, (old, old))  # every heartbeat is an hour old
    statuses = {r.config_id: r.status for r in registry.runs()}
    assert statuses == {"aaaaaaaaaaaa": "completed", "bbbbbbbbbbbb": "failed", "cccccccccccc": "stale"}
    assert [r.config_id for r in registry.runs(status="stale")] == ["cccccccccccc"]
    assert registry.runs(status="running") == []
    assert Registry(root, stale_after=7200).get("abc1234-cccc").status == "running"


def test_best_min_and_max(root: Path):
    registry = Registry(root)
    ranked = registry.best("val/loss")
    assert [(r.config_id, v) for r, v in ranked] == [
        ("bbbbbbbbbbbb", 0.3),
        ("aaaaaaaaaaaa", 0.5),
        ("cccccccccccc", 0.6),
    ]
    assert [(r.config_id, v) for r, v in registry.best("val/loss", maximize=True)] == [
        ("aaaaaaaaaaaa", 0.9),
        ("bbbbbbbbbbbb", 0.8),
        ("cccccccccccc", 0.6),
    ]
    assert [r.config_id for r, _ in registry.best("val/acc", maximize=True, limit=2)] == [
        "cccccccccccc",
        "aaaaaaaaaaaa",
    ]
    assert [r.config_id for r, _ in registry.best("val/acc", lineage="mlp")] == ["bbbbbbbbbbbb", "aaaaaaaaaaaa"]
    assert registry.best("val/nothing") == []
    with pytest.raises(RegistryError, match="split/name"):
        registry.best("loss")


def test_get_exact_prefix_ambiguous_unknown(root: Path):
    registry = Registry(root)
    assert registry.get("abc1234-aaaaaaaaaaaa").config_id == "aaaaaaaaaaaa"
    assert registry.get("abc1234-b").config_id == "bbbbbbbbbbbb"
    assert registry.get("mlp-abc1234/abc1234-aaaaaaaaaaaa").config_id == "aaaaaaaaaaaa"  # the group/id directory
    assert registry.get("cnn-").config_id == "cccccccccccc"
    with pytest.raises(AmbiguousRunError) as ambiguous:
        registry.get("abc1234")
    assert len(ambiguous.value.matches) == 3
    assert "abc1234-aaaaaaaaaaaa" in str(ambiguous.value) and "abc1234-cccccccccccc" in str(ambiguous.value)
    with pytest.raises(RunNotFoundError) as unknown:
        registry.get("abc1243-aaaaaaaaaaaa")
    assert unknown.value.suggestions[0] == "abc1234-aaaaaaaaaaaa"
    assert "closest: abc1234-aaaaaaaaaaaa" in str(unknown.value)
    assert isinstance(unknown.value, PerdureError)


def test_same_id_in_two_lineages_is_ambiguous(tmp_path: Path):
    make_run(tmp_path, "aaaaaaaaaaaa", lineage="one")
    make_run(tmp_path, "aaaaaaaaaaaa", lineage="two")
    registry = Registry(tmp_path)
    with pytest.raises(AmbiguousRunError, match="matches 2 runs"):
        registry.get("abc1234-aaaaaaaaaaaa")
    assert registry.get("two-abc1234/abc1234-aaaaaaaaaaaa").lineage == "two"


def test_corrupt_sidecar_is_reported_and_skipped(root: Path):
    bad = root / "mlp-abc1234" / "abc1234-bbbbbbbbbbbb" / SIDECAR_NAME
    registry = Registry(root)
    assert len(registry.runs()) == 3
    bad.write_text('{"format": "perdure-sidecar/1"')  # truncated
    report = registry.scan()
    assert [issue.path for issue in report.errors] == [bad] and "not valid JSON" in report.errors[0].reason
    assert [r.config_id for r in registry.runs()] == ["cccccccccccc", "aaaaaaaaaaaa"]
    assert registry.last_scan.errors and registry.last_scan.errors[0].path == bad  # still reported, not re-read
    make_run(root, "bbbbbbbbbbbb", val_losses=(0.8, 0.3), status="failed")  # fixed
    assert registry.scan().errors == []
    assert len(registry.runs()) == 3


def test_root_defaults_to_env(root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv(ROOT_ENV, str(root))
    assert Registry().root == root and len(Registry().runs()) == 3
    monkeypatch.delenv(ROOT_ENV)
    monkeypatch.chdir(tmp_path)  # ./runs is the default, and the fixture's root is exactly that
    assert Registry().root == tmp_path / "runs" and len(Registry().runs()) == 3


def test_missing_root(tmp_path: Path):
    with pytest.raises(RegistryError, match="does not exist"):
        Registry(tmp_path / "nowhere").runs()
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RegistryError, match="a-file is a regular file, not a directory; pass --root DIR"):
        Registry(tmp_path / "a-file").runs()


def test_sidecars_are_found_two_levels_down_only(root: Path):
    (root / "stray").mkdir()
    (root / "stray" / SIDECAR_NAME).write_text("{}")  # one level down: not a run dir
    deep = root / "mlp-abc1234" / "abc1234-aaaaaaaaaaaa" / "checkpoints"
    deep.mkdir()
    (deep / SIDECAR_NAME).write_text("{}")
    report = Registry(root).scan()
    assert report.found == 3 and report.errors == []


# ---------------------------------------------------------------------- export


def test_export_csv_and_json(root: Path, tmp_path: Path):
    registry = Registry(root)
    csv_path = registry.export(tmp_path / "out" / "runs.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert [row["run_id"] for row in rows] == [r.run_id for r in registry.runs()]
    by_id = {row["config_id"]: row for row in rows}
    assert by_id["aaaaaaaaaaaa"]["val/loss.min"] == "0.5" and by_id["aaaaaaaaaaaa"]["val/loss.min_step"] == "20"
    assert by_id["aaaaaaaaaaaa"]["hparams.optim.lr"] == "0.001" and by_id["aaaaaaaaaaaa"]["tags"] == "baseline"
    assert by_id["bbbbbbbbbbbb"]["status"] == "failed" and by_id["bbbbbbbbbbbb"]["latest_checkpoint"]

    json_path = registry.export(tmp_path / "runs.json", status="completed")
    data = json.loads(json_path.read_text())
    assert [run["config_id"] for run in data] == ["aaaaaaaaaaaa"]
    assert data[0]["summary"]["val/loss"]["max"] == 0.9 and data[0]["path"] == str(registry.get("abc1234-a").path)

    with pytest.raises(RegistryError, match=r"\.csv, \.json, \.parquet"):
        registry.export(tmp_path / "runs.xlsx")


def test_export_parquet(root: Path, tmp_path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        with pytest.raises(RegistryError, match="pip install pyarrow"):
            Registry(root).export(tmp_path / "runs.parquet")
        assert not (tmp_path / "runs.parquet").exists()
    else:
        table = pq.read_table(Registry(root).export(tmp_path / "runs.parquet"))
        assert table.num_rows == 3


# ---------------------------------------------------------------------- command line


def test_cli_ls(root: Path, capsys):
    code, out, err = cli(capsys, "ls", "--root", str(root))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "LINEAGE", "STATUS", "STEP", "val/loss", "train/loss", "GOODPUT", "UPDATED"]
    assert [line.split()[0] for line in lines[1:]] == [
        "abc1234-cccccccccccc",
        "abc1234-bbbbbbbbbbbb",
        "abc1234-aaaaaaaaaaaa",
    ]
    assert lines[3].split()[1:6] == ["mlp", "completed", "30", "0.7", "1.4"]
    start = lines[0].index("UPDATED")  # columns are aligned
    assert all(line[start - 2 : start] == "  " and line[start : start + 4].isdigit() for line in lines[1:])
    assert cli(capsys, "ls", "--root", str(root), "--lineage", "cnn")[1].count("abc1234-") == 1
    assert cli(capsys, "ls", "--root", str(root), "--tag", "baseline")[1].count("abc1234-") == 1
    code, out, err = cli(capsys, "ls", "--root", str(root), "--status", "preempted")
    assert code == 0 and out == "" and "no runs" in err and "--status preempted" in err
    out = cli(capsys, "ls", "--root", str(root), "--metric", "val/acc", "-n", "1")[1]
    assert out.splitlines()[0].split()[4] == "val/acc" and len(out.splitlines()) == 2


def test_cli_ls_rescans_by_itself(root: Path, capsys):
    before = cli(capsys, "ls", "--root", str(root))[1]
    make_run(root, "dddddddddddd", lineage="new")
    after = cli(capsys, "ls", "--root", str(root))[1]
    assert "abc1234-dddddddddddd" not in before and after.splitlines()[1].startswith("abc1234-dddddddddddd")


def test_cli_uses_perdure_root(root: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ROOT_ENV, str(root))
    assert cli(capsys, "ls")[1].count("abc1234-") == 3


def test_cli_best(root: Path, capsys):
    code, out, _ = cli(capsys, "best", "val/loss", "--root", str(root))
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:5] == ["#", "ID", "LINEAGE", "STATUS", "val/loss"]
    assert [line.split()[1] for line in lines[1:]] == [
        "abc1234-bbbbbbbbbbbb",
        "abc1234-aaaaaaaaaaaa",
        "abc1234-cccccccccccc",
    ]
    assert lines[1].split()[4:6] == ["0.3", "20"]
    out = cli(capsys, "best", "val/acc", "--max", "--root", str(root), "-n", "2")[1]
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["abc1234-cccccccccccc", "abc1234-aaaaaaaaaaaa"]
    assert "(max)" in out.splitlines()[0]
    code, _, err = cli(capsys, "best", "val/los", "--root", str(root))
    assert code == 2 and "no run" in err and "val/loss" in err


def test_cli_show(root: Path, capsys):
    run_dir = root / "mlp-abc1234" / "abc1234-aaaaaaaaaaaa"
    resumed = Sidecar(
        run_dir,
        run_id="abc1234-aaaaaaaaaaaa",
        lineage="mlp",
        code_id="abc1234",
        config_id="aaaaaaaaaaaa",
        hparams={"optim": {"lr": 0.001}},
        tags=["baseline"],
    )
    resumed.start_attempt(
        started=utc_stamp(),
        restart_counts={"SLURM_RESTART_COUNT": 1},
        resumed_from="ckpt-s000000000020",
        resumed_step=20,
    )
    resumed.record(step=40, save_seconds=1.5)
    resumed.finish_attempt("completed", "budget reached")
    resumed.write()
    code, out, err = cli(capsys, "show", "abc1234-a", "--root", str(root))
    assert code == 0 and err == ""
    assert "abc1234-aaaaaaaaaaaa" in out and str(run_dir) in out and "completed" in out
    assert "metrics" in out and "val/loss" in out
    attempts = out.split("attempts")[1].split("hparams")[0].strip().splitlines()
    assert attempts[0].split()[:4] == ["#", "STARTED", "ENDED", "STATUS"]
    assert len(attempts) == 3  # header + two attempts
    second = attempts[2]
    assert "completed" in second and "SLURM_RESTART_COUNT=1" in second and "budget reached" in second
    assert second.split()[6:9] == ["20", "20", "10"]  # from step 20, 20 done, 10 lost (the first reached 30)
    assert "optim.lr" in out.split("hparams")[1]


def test_cli_show_stale(root: Path, capsys):
    os.utime(root / "cnn-abc1234" / "abc1234-cccccccccccc" / HEARTBEAT_NAME, (1_000, 1_000))
    out = cli(capsys, "show", "abc1234-c", "--root", str(root))[1]
    assert "stale (sidecar says running" in out


def test_cli_show_unknown_and_ambiguous(root: Path, capsys):
    code, out, err = cli(capsys, "show", "abc1234-aaaaaaaaaaab", "--root", str(root))
    assert code == 2 and out == ""
    assert err.startswith("error: no run 'abc1234-aaaaaaaaaaab'") and "closest: abc1234-aaaaaaaaaaaa" in err
    code, _, err = cli(capsys, "show", "abc", "--root", str(root))
    assert code == 2 and "matches 3 runs" in err


def test_cli_corrupt_sidecar(root: Path, capsys):
    bad = root / "cnn-abc1234" / "abc1234-cccccccccccc" / SIDECAR_NAME
    bad.write_text("garbage")
    code, out, err = cli(capsys, "ls", "--root", str(root))
    assert code == 0 and "abc1234-cccccccccccc" not in out and out.count("abc1234-") == 2
    assert f"skipped {bad}" in err and "not valid JSON" in err
    code, out, err = cli(capsys, "scan", "--root", str(root))
    assert code == 0 and "1 skipped" in out and f"skipped {bad}" in err


def test_cli_export(root: Path, tmp_path: Path, capsys):
    code, out, _ = cli(capsys, "export", str(tmp_path / "runs.csv"), "--root", str(root), "--lineage", "mlp")
    assert code == 0 and "wrote 2 run(s)" in out
    assert len(list(csv.DictReader((tmp_path / "runs.csv").open()))) == 2
    code, _, _ = cli(capsys, "export", str(tmp_path / "runs.json"), "--root", str(root))
    assert code == 0 and len(json.loads((tmp_path / "runs.json").read_text())) == 3
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        code, _, err = cli(capsys, "export", str(tmp_path / "runs.parquet"), "--root", str(root))
        assert code == 2 and "pip install pyarrow" in err


def test_cli_missing_root(tmp_path: Path, capsys):
    code, _, err = cli(capsys, "ls", "--root", str(tmp_path / "nowhere"))
    assert code == 2 and "does not exist" in err


# ---------------------------------------------------------------------- public module


def test_public_module(root: Path, tmp_path: Path):
    assert public.Registry is Registry
    assert len(public.runs(root)) == 3
    assert public.runs(root, lineage="cnn")[0].config_id == "cccccccccccc"
    assert public.get("abc1234-b", root).status == "failed"
    assert public.best("val/loss", root, limit=1)[0][1] == 0.3
    assert public.scan(root).found == 3
    assert public.export(tmp_path / "x.json", root).exists()
