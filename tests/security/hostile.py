"""Helpers of the hostile-input tests: victim runs to tamper with, payloads, and the real commands.

Every payload is what an attacker would hand over: a pickle whose `__reduce__` creates a marker file (and, in the
DCP metadata case, then returns the real metadata so that training would continue normally), with the checkpoint's
manifest recomputed, since whoever hands over a checkpoint writes its checksums too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from perdure.checkpoints.commit import MANIFEST_NAME, hash_file, read_pointer
from tests import zygote
from tests.runs import PINNED_CODE, SCRIPTS, environment
from tests.scripts.resumable import ResumableRunner, make_config

RUN_ID = "victim"
TINY = {"steps": 4, "ckpt.interval": 2, "workspace.id": RUN_ID, "dataset_size": 32, "log.interval": 2}
TINY_ARGS = ("--steps", "6", "--ckpt.interval", "2", "--workspace.id", RUN_ID, "--dataset_size", "32")
TINY_ARGS += ("--log.interval", "2")


def train_victim(root: Path, **settings) -> Path:
    """Train the tiny victim run in-process (steps 4, checkpoints at 2 and 4); return its run directory. Its code
    identity is that of the training script, so that the script's own processes continue the same run."""
    argv, sys.argv = sys.argv, [str(SCRIPTS / "resumable.py")]
    try:
        runner = ResumableRunner(make_config(root, **{**TINY, **settings}))
        runner.train()
    finally:
        sys.argv = argv
    return runner.run_dir.path


def copy_root(source: Path, target: Path) -> Path:
    """A private copy of a workspace root (symlinks copied as links)."""
    shutil.copytree(source, target, symlinks=True)
    return target


def run_dir_of(root: Path) -> Path:
    (found,) = root.glob(f"*/{RUN_ID}")
    return found


def latest(run: Path) -> Path:
    checkpoints = run / "checkpoints"
    return checkpoints / read_pointer(checkpoints, "latest")


def resume(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real command: relaunch the victim's training script on `root` (it continues to step 6)."""
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *PINNED_CODE, *TINY_ARGS]
    command += args
    return zygote.run(command, env=environment(), capture_output=True, timeout=timeout)


def perdure_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The real `perdure` command (bytes output, so an escape sequence cannot hide)."""
    command = [sys.executable, "-m", "perdure.cli.main", *map(str, args)]
    return zygote.run(command, env=environment(), capture_output=True, timeout=timeout)


def perdure_cli_each(*commands: tuple, timeout: float = 60) -> tuple[list[int], bytes]:
    """Several `perdure` commands through the real entry point, in one process (one import of torch instead of
    one per command): their exit codes, and everything they wrote to stdout and stderr."""
    program = (
        "import json, sys; from perdure.cli.main import main; "
        "codes = [main(command) for command in json.loads(sys.argv[1])]; "
        "sys.stdout.flush(); sys.stderr.write('EXIT-CODES ' + json.dumps(codes))"
    )
    argv = json.dumps([[str(part) for part in command] for command in commands])
    result = zygote.run([sys.executable, "-c", program, argv], env=environment(), capture_output=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert b"EXIT-CODES " in output, output.decode("utf-8", "replace")
    output, codes = output.rsplit(b"EXIT-CODES ", 1)
    return json.loads(codes), output


def text(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr).decode("utf-8", "replace")


def rewrite_manifest(checkpoint: Path) -> None:
    """Recompute the size and checksum of every file the manifest lists, as an attacker can."""
    path = checkpoint / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for relative in manifest["files"]:
        record = hash_file(checkpoint / relative)
        manifest["files"][relative] = {"size": record.size, "digest": record.digest}
    path.write_text(json.dumps(manifest, indent=2))


class CodeThatReturns:
    """Unpickles by running `eval` of an expression that creates `marker`, then returns `value`."""

    def __init__(self, marker: Path, value: object) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self):
        value = pickle.dumps(self.value)
        expression = f"open({str(self.marker)!r}, 'w').close() or __import__('pickle').loads({value!r})"
        return (eval, (expression,))


def poison_dcp_metadata(checkpoint: Path, marker: Path) -> None:
    """Replace DCP's `.metadata` by a pickle that creates `marker` and then yields the real metadata."""
    real = pickle.loads((checkpoint / ".metadata").read_bytes())  # the test's own file: safe to unpickle here
    (checkpoint / ".metadata").write_bytes(pickle.dumps(CodeThatReturns(marker, real)))
    rewrite_manifest(checkpoint)


def poison_dcp_entry(checkpoint: Path, marker: Path, key: str = "optimizer.param_groups.0.lr") -> None:
    """Make DCP's non-tensor entry `key` a torch.save of code: the bytes are appended to the shard and the (plain,
    legitimate) metadata points at them."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(CodeThatReturns(marker, 1e-3), buffer)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        file.write(buffer.getvalue())
    info.offset, info.length = offset, len(buffer.getvalue())
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(checkpoint)


def poison_torch_file(path: Path, marker: Path) -> None:
    """Replace a checkpoint's torch.save file by one whose unpickling creates `marker`."""
    state = torch.load(path, weights_only=True)
    state["state"] = CodeThatReturns(marker, state.get("state"))
    torch.save(state, path)
    rewrite_manifest(path.parent)


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry under `directory` (not following symlinks) with a digest of each file: to assert nothing
    outside changed or appeared."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(directory).as_posix()
            if path.is_symlink():
                found[relative] = "link:" + os.readlink(path)
            elif path.is_file():
                found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[relative] = "dir"
    return found


def set_attribute_of_class(module: str, name: str, attribute: str, value: tuple[str, str]) -> bytes:
    """Pickle opcodes (protocol 2, no memo) that set `<module>.<name>.<attribute> = <value's global>` with BUILD and
    pop the class again: what a hand-made pickle can do to any class its unpickler hands out."""
    build = b"c%s\n%s\nN}X%s%sc%s\n%s\ns\x86b0" % (
        module.encode(), name.encode(), len(attribute).to_bytes(4, "little"), attribute.encode(),
        value[0].encode(), value[1].encode(),
    )  # fmt: skip
    return build


def poison_dcp_metadata_classes(checkpoint: Path) -> None:
    """DCP's `.metadata` made to first set `Metadata.__getstate__ = torch.Size` (every later DCP save of the process
    pickles an empty Metadata) and `pathlib.Path.is_symlink = torch.Size` (every later symlink check answers no), then
    hold the untouched original: training would go on normally."""
    real = pickle.dumps(pickle.loads((checkpoint / ".metadata").read_bytes()), protocol=2)
    assert real.startswith(b"\x80\x02") and real.endswith(b".")
    attacks = set_attribute_of_class("torch.distributed.checkpoint.metadata", "Metadata", "__getstate__",
                                     ("torch", "Size"))  # fmt: skip
    attacks += set_attribute_of_class("pathlib", "Path", "is_symlink", ("torch", "Size"))
    (checkpoint / ".metadata").write_bytes(real[:2] + attacks + real[2:])
    rewrite_manifest(checkpoint)
