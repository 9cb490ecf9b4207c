"""`perdure ckpt ls | verify | export | prune` on real checkpoints written by FileCheckpointManager."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from perdure.checkpoints.base import CheckpointPolicy
from perdure.checkpoints.commit import checkpoint_name, make_staging_dir, quarantine
from perdure.checkpoints.file import FileCheckpointManager
from perdure.cli import main as cli
from tests.test_run_lock import kill, start_holder

ALL_SUBCOMMANDS = dict(cli.SUBCOMMANDS)
STEPS = (10, 20, 30, 40, 50)
BEST = 20


class Counter:
    """The smallest stateful object: the step it was saved at."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Shadow:
    """Stands in for the EMA: `state_dict()` has the shape perdure.runners.ema writes."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}

    def state_dict(self) -> dict:
        return {"decay": 0.9, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = state["shadow"]


class Net(nn.Module):
    """A model with tied weights (shared storage), as language models have."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))


def model_at(step: int) -> Net:
    torch.manual_seed(step)
    return Net()


def name(step: int) -> str:
    return checkpoint_name(step=step)


@pytest.fixture
def run(tmp_path) -> Path:
    """A run dir with five committed checkpoints; `best` names step 20, `latest` step 50."""
    run_dir = tmp_path / "run"
    manager = FileCheckpointManager(run_dir / "checkpoints", CheckpointPolicy(), identity={"config_id": "c"})
    for step in STEPS:
        model = model_at(step)
        states = {"state": Counter(step), "model": model, "ema": Shadow(model)}
        meta = {"global_step": step, "epoch": step // 20, "reason": "interval"}
        manager.save(name(step), states, {"rng": Counter(step)}, meta=meta, is_best=step == BEST)
    return run_dir


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / name(step)


def perdure(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- ls ------------------------------------------------------------------------------------------------------------


def test_ls_lists_newest_first_with_pointers(run, capsys):
    code, out, _ = perdure(capsys, "ls", run)
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("ckpt-")]
    assert [row[0] for row in rows] == [name(s) for s in reversed(STEPS)]
    by_name = {row[0]: row for row in rows}
    assert by_name[name(50)][-1] == "latest" and by_name[name(BEST)][-1] == "best" and by_name[name(30)][-1] == "-"
    assert by_name[name(40)][1:3] == ["40", "2"]  # step, epoch
    assert all(row[-2] == "ok" for row in rows)
    assert "KiB" in out and "NAME" in out and "CREATED" in out


def test_ls_shows_failures_quarantine_and_staging(run, capsys):
    checkpoints = run / "checkpoints"
    truncate(ckpt(run, 30) / "state.pth")
    junk = make_staging_dir(checkpoints, name(60))
    quarantine(make_staging_dir(checkpoints, name(55)), "interrupted save: never committed")
    code, out, _ = perdure(capsys, "ls", checkpoints)  # the checkpoints dir works too
    assert code == 0
    assert f"{name(30)} FAILED: state.pth: size" in out
    assert "quarantined" in out and "interrupted save: never committed" in out
    assert junk.name in out

    _, quick, _ = perdure(capsys, "ls", run, "--quick")
    assert "sizes ok" in quick


# ---- verify --------------------------------------------------------------------------------------------------------


def test_verify_ok(run, capsys):
    code, out, _ = perdure(capsys, "verify", run)
    assert code == 0, out
    assert out.count("OK      ") == len(STEPS) + 2  # every checkpoint, then latest and best
    assert f"latest -> {name(50)}" in out and f"best -> {name(BEST)}" in out

    code, out, _ = perdure(capsys, "verify", ckpt(run, 20))
    assert code == 0 and out.startswith("OK") and "checksums" in out


def test_verify_names_the_bad_file(run, capsys):
    truncate(ckpt(run, 30) / "state.pth")
    code, out, _ = perdure(capsys, "verify", ckpt(run, 30))
    assert code == 1
    assert out.startswith("FAILED") and "state.pth: size" in out and "in manifest" in out

    code, out, _ = perdure(capsys, "verify", run)
    assert code == 1
    assert f"FAILED  {ckpt(run, 30)}: state.pth: size" in out
    assert out.count("OK      ") == len(STEPS) - 1 + 2


def test_verify_deep_catches_what_quick_does_not(run, capsys):
    flip_a_byte(ckpt(run, 50) / "rank00000.pth")
    code, out, _ = perdure(capsys, "verify", run, "--quick")
    assert code == 0, out
    code, out, _ = perdure(capsys, "verify", run)
    assert code == 1
    assert "rank00000.pth: checksum mismatch" in out
    assert f"{run / 'checkpoints' / 'latest'}: names {name(50)}, which does not verify" in out


def test_verify_checks_pointers(run, capsys):
    (run / "checkpoints" / "best").write_text("ckpt-s000000000099\n")
    code, out, _ = perdure(capsys, "verify", run)
    assert code == 1 and "best: names ckpt-s000000000099, which does not exist" in out

    (run / "checkpoints" / "best").unlink()
    (run / "checkpoints" / "latest").write_text(name(40) + "\n")  # an interrupted pointer update
    code, out, _ = perdure(capsys, "verify", run)
    assert code == 0 and f"NOTE    latest names {name(40)} but {name(50)} is newer" in out


def test_verify_errors(tmp_path, capsys):
    code, _, err = perdure(capsys, "verify", tmp_path / "nowhere")
    assert code == 2 and err.startswith("error: ") and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = perdure(capsys, "verify", tmp_path / "empty")
    assert code == 2 and "is not a run" in err
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    code, out, _ = perdure(capsys, "verify", tmp_path / "fresh")
    assert code == 1 and "no committed checkpoint" in out


# ---- export --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_export_pth_latest_with_dtype(run, tmp_path, capsys, dtype):
    out = tmp_path / "out" / "model.pth"
    code, stdout, _ = perdure(capsys, "export", run, out, *(["--dtype", dtype] if dtype else []))
    assert code == 0, stdout
    assert name(50) in stdout
    weights = torch.load(out, weights_only=True)
    expected = model_at(50).state_dict()
    assert weights.keys() == expected.keys()
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, None: torch.float32}[dtype]
    for key, tensor in expected.items():
        want = tensor.to(target) if tensor.is_floating_point() else tensor
        assert weights[key].dtype == want.dtype and torch.equal(weights[key], want), key


def test_export_ema_of_one_checkpoint(run, tmp_path, capsys):
    out = tmp_path / "ema.pth"
    code, stdout, _ = perdure(capsys, "export", ckpt(run, 20), out, "--ema")
    assert code == 0 and "EMA weights" in stdout
    weights = torch.load(out, weights_only=True)
    for key, tensor in model_at(20).state_dict().items():
        assert torch.equal(weights[key], tensor * 0.5), key


def test_export_safetensors(run, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    code, stdout, _ = perdure(capsys, "export", ckpt(run, 40), out)
    assert code == 0, stdout
    weights = load_file(out)
    for key, tensor in model_at(40).state_dict().items():  # the tied weight is written under both names
        assert torch.equal(weights[key], tensor), key

    code, _, err = perdure(capsys, "export", ckpt(run, 40), out, "--dtype", "bf16")
    assert code == 2 and "--force" in err
    code, _, _ = perdure(capsys, "export", ckpt(run, 40), out, "--dtype", "bf16", "--force")
    assert code == 0
    weights = load_file(out)
    assert weights["hidden.weight"].dtype == torch.bfloat16 and weights["count"].dtype == torch.int64
    assert torch.equal(weights["hidden.weight"], model_at(40).hidden.weight.detach().bfloat16())


def test_export_safetensors_without_the_package(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # makes the import fail
    code, _, err = perdure(capsys, "export", run, tmp_path / "model.safetensors")
    assert code == 2 and "pip install safetensors" in err
    assert not list(tmp_path.glob("*.safetensors*"))


def test_export_errors(run, tmp_path, capsys):
    code, _, err = perdure(capsys, "export", run, tmp_path / "model.bin")
    assert code == 2 and ".pth or .safetensors" in err
    truncate(ckpt(run, 30) / "state.pth")
    code, _, err = perdure(capsys, "export", ckpt(run, 30), tmp_path / "model.pth")
    assert code == 2 and "state.pth: size" in err and not (tmp_path / "model.pth").exists()


# ---- prune ---------------------------------------------------------------------------------------------------------


def committed(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-"))


def test_prune_keeps_newest_and_pointer_targets(run, capsys):
    code, out, _ = perdure(capsys, "prune", run, "--keep", "2", "--dry-run")
    assert code == 0 and f"would remove {name(30)}" in out and f"would remove {name(10)}" in out
    assert committed(run) == [name(s) for s in STEPS]

    code, out, _ = perdure(capsys, "prune", run, "--keep", "2")
    assert code == 0
    assert f"removed {name(30)}" in out and f"removed {name(10)}" in out
    assert committed(run) == [name(20), name(40), name(50)]  # best (20) is never removed
    assert not list((run / "checkpoints").glob(".prune-*"))
    code, out, _ = perdure(capsys, "verify", run)
    assert code == 0, out


def test_prune_never_removes_a_corrupt_checkpoint_or_counts_it(run, capsys):
    truncate(ckpt(run, 40) / "state.pth")
    code, out, _ = perdure(capsys, "prune", run / "checkpoints", "--keep", "1")
    assert code == 0
    assert f"left {name(40)}: it fails verification" in out
    assert committed(run) == [name(20), name(40), name(50)]


def test_prune_refuses_while_the_run_is_live(run, capsys):
    holder, _ = start_holder(run)
    try:
        code, _, err = perdure(capsys, "prune", run, "--keep", "1")
    finally:
        kill(holder)
    assert code == 2 and f"is in use by pid {holder.pid}" in err
    assert committed(run) == [name(s) for s in STEPS]
    code, _, _ = perdure(capsys, "prune", run, "--keep", "1")  # the holder is gone
    assert code == 0 and committed(run) == [name(20), name(50)]


def test_prune_errors(run, capsys):
    code, _, err = perdure(capsys, "prune", run, "--keep", "0")
    assert code == 2 and "keep at least 1" in err
    code, _, err = perdure(capsys, "prune", ckpt(run, 10), "--keep", "1")
    assert code == 2 and "is one checkpoint" in err


# ---- the console script --------------------------------------------------------------------------------------------


def test_console_script(run):
    script = shutil.which("perdure", path=str(Path(sys.executable).parent))
    assert script, "the `perdure` console script is not installed next to this Python (pip install -e .)"
    ok = subprocess.run([script, "ckpt", "verify", str(run)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"OK      latest -> {name(50)}" in ok.stdout
    truncate(ckpt(run, 50) / "state.pth")
    bad = subprocess.run([script, "ckpt", "verify", str(ckpt(run, 50))], capture_output=True, text=True)
    assert bad.returncode == 1 and "state.pth: size" in bad.stdout
