"""Save throughput: a synchronous perdure checkpoint of a ~100M-parameter model with AdamW state, against the disk.

The state is a 6 x Linear(4096, 4096) model (100.7M fp32 parameters) and an AdamW optimizer whose state (exp_avg,
exp_avg_sq) was populated by one step: about 1.2 GB. Each round times, in a rotating order:

  perdure                 FileCheckpointManager.save(...): torch.save through the hashing writer, fsync of every
                          file, manifest written last, directory rename + fsync, `latest` pointer: a real save
  torch.save              torch.save(state_dict, path) of the same model + optimizer state dicts, then os.fsync
  torch.save(fileobj)     the same into an open file object (how perdure calls torch.save), without hashing
  dd                      dd if=/dev/zero of=... bs=4M count=N conv=fsync for the same bytes: the disk itself
  perdure, no zip crc32   diagnostic: the perdure save with torch's zip CRC32 switched off
                          (torch.utils.serialization.config.save.compute_crc32), which perdure's xxh3 supersedes

and, after the perdure save, the deep verification (re-hash of every file against the manifest) twice: warm (the
pages just written are still in the page cache, as when verifying right after a save) and cold (the files' pages
evicted with posix_fadvise(DONTNEED) first, as when a restarted job resolves its checkpoint).

Page cache: every write starts after os.sync() with no page of its file cached (each trial writes a new file and
deletes it afterwards, then syncs again), and every write ends with fsync inside the timed region, so the timings
include getting the bytes to the device. Only the files of this benchmark are evicted (fadvise); the machine-wide
cache is never dropped. An untimed first round warms every method. Files go to a temporary directory under
`bench-results/` (the repository's disk). GB are 10^9 bytes.

    python benchmarks/save_throughput.py [--repeats 5] [--width 4096] [--layers 6] [--no-warmup]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization.config as serialization_config
import xxhash
from _common import RESULTS_DIR, format_table, format_targets, load_note, median, setup_threads, target, write_results
from torch import nn

from perdure import CheckpointPolicy, FileCheckpointManager
from perdure.checkpoints.commit import verify_checkpoint
from perdure.runners.rng import RNGState

NAME = "save_throughput"
TARGET_RATIO = 0.9
DD_BLOCK = 4 << 20
METHODS = ("perdure", "torch.save", "torch.save(fileobj)", "dd", "perdure, no zip crc32")


def make_state(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(paths: list[Path]) -> None:
    """Drop these files' (clean) pages from the page cache, so the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def timed_write(fn: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """Wall seconds and CPU seconds (this process and dd) of one write."""
    user, system = cpu_seconds()
    seconds, result = timed(fn)
    user_after, system_after = cpu_seconds()
    times = {"seconds": seconds, "user_seconds": user_after - user, "system_seconds": system_after - system}
    return {**times, "cpu_seconds": times["user_seconds"] + times["system_seconds"]}, result


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and its finished children (dd)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


@contextlib.contextmanager
def zip_crc32(enabled: bool):
    previous = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = enabled
    try:
        yield
    finally:
        serialization_config.save.compute_crc32 = previous


# ---- one trial of each method: (seconds, bytes on disk, extra results) ---------------------------------------


def trial_perdure(
    workdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, index: int, crc32: bool = True
) -> dict[str, Any]:
    manager = FileCheckpointManager(workdir / "checkpoints", CheckpointPolicy())

    def save() -> Path:
        with zip_crc32(crc32):
            return manager.save(
                "ckpt-s000000000001",
                {"model": model, "optimizer": optimizer},
                {"rng": RNGState()},
                meta={"global_step": 1, "round": index},
            )

    times, path = timed_write(save)
    files = [p for p in path.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    warm, _ = timed(lambda: verify_checkpoint(path, deep=True))
    evict(files)
    cold, _ = timed(lambda: verify_checkpoint(path, deep=True))
    return {**times, "bytes": size, "verify_warm_seconds": warm, "verify_cold_seconds": cold}


def trial_torch_save(workdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    path = workdir / "plain.pth"

    def save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        fsync_file(path)

    times, _ = timed_write(save)
    return {**times, "bytes": path.stat().st_size}


def trial_torch_save_fileobj(workdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    path = workdir / "plain-fileobj.pth"

    def save() -> None:
        with open(path, "xb") as file:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, file)
            file.flush()
            os.fsync(file.fileno())

    times, _ = timed_write(save)
    return {**times, "bytes": path.stat().st_size}


def trial_dd(workdir: Path, nbytes: int) -> dict[str, Any]:
    path = workdir / "dd.bin"
    count = math.ceil(nbytes / DD_BLOCK)
    command = ["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK}", f"count={count}", "conv=fsync", "status=none"]
    times, _ = timed_write(lambda: subprocess.run(command, check=True))
    return {**times, "bytes": path.stat().st_size}


def hash_speed(nbytes: int = 512 << 20) -> float:
    """xxh3_128 throughput over an in-memory buffer (GB/s): the ceiling of hashing alone."""
    buffer = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    hasher = xxhash.xxh3_128()
    seconds, _ = timed(lambda: hasher.update(buffer))
    return nbytes / seconds / 1e9


def filesystem_of(path: Path) -> str:
    """`<device> <mount point> <type>` of the filesystem holding `path` (from /proc/mounts)."""
    path = path.resolve()
    best = ("?", "", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > len(best[1]):
                best = (device, mount, fstype)
    except OSError:
        pass
    return " ".join(best)


# ---- measurement ---------------------------------------------------------------------------------------------


def run_trial(method: str, workdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, nbytes: int, index: int):
    workdir.mkdir()
    os.sync()  # nothing else dirty may land in this trial's fsync
    if method == "perdure":
        result = trial_perdure(workdir, model, optimizer, index)
    elif method == "perdure, no zip crc32":
        result = trial_perdure(workdir, model, optimizer, index, crc32=False)
    elif method == "torch.save":
        result = trial_torch_save(workdir, model, optimizer)
    elif method == "torch.save(fileobj)":
        result = trial_torch_save_fileobj(workdir, model, optimizer)
    else:
        result = trial_dd(workdir, nbytes)
    shutil.rmtree(workdir)
    os.sync()
    result["gb_per_s"] = result["bytes"] / result["seconds"] / 1e9
    return result


def measure(width: int, layers: int, repeats: int, warmup: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    seconds, (model, optimizer) = timed(lambda: make_state(width, layers))
    params = sum(p.numel() for p in model.parameters())
    nbytes = tensor_bytes(model, optimizer)
    print(f"state: {params / 1e6:.1f}M parameters + AdamW state = {nbytes / 1e9:.3f} GB (built in {seconds:.1f}s)")
    RESULTS_DIR.mkdir(exist_ok=True)
    trials: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
    with tempfile.TemporaryDirectory(prefix="save-", dir=RESULTS_DIR) as tmp:
        base = Path(tmp)
        info = {
            "directory_filesystem": filesystem_of(base),
            "tmp_filesystem": filesystem_of(Path(tempfile.gettempdir())),
            "same_device_as_repo": os.stat(base).st_dev == os.stat(RESULTS_DIR.parent).st_dev,
            "parameters": params,
            "tensor_bytes": nbytes,
        }
        if warmup:  # untimed: first writes into never-used memory and a cold disk are slower for every method
            for method in METHODS:
                run_trial(method, base / f"warmup-{METHODS.index(method)}", model, optimizer, nbytes, -1)
        for index in range(repeats):
            shift = index % len(METHODS)
            for method in METHODS[shift:] + METHODS[:shift]:
                workdir = base / f"trial-{index}-{METHODS.index(method)}"
                trials[method].append(run_trial(method, workdir, model, optimizer, nbytes, index))
            line = "  ".join(f"{m} {trials[m][-1]['gb_per_s']:.3f}" for m in METHODS)
            print(f"round {index + 1}/{repeats} (GB/s): {line}", flush=True)
    info["xxh3_128_in_memory_gb_per_s"] = hash_speed()
    return trials, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every method; medians are reported")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first round")
    args = parser.parse_args(argv)
    threads = setup_threads()
    print(f"{NAME}: {args.repeats} rounds, torch threads {threads}", flush=True)
    trials, info = measure(args.width, args.layers, args.repeats, warmup=not args.no_warmup)

    speed = {method: median(t["gb_per_s"] for t in trials[method]) for method in METHODS}
    paired = {
        method: [p["gb_per_s"] / b["gb_per_s"] for p, b in zip(trials["perdure"], trials[method])] for method in METHODS
    }
    perdure_runs = trials["perdure"]
    checkpoint_bytes = median(t["bytes"] for t in perdure_runs)
    verify_warm = median(t["verify_warm_seconds"] for t in perdure_runs)
    verify_cold = median(t["verify_cold_seconds"] for t in perdure_runs)
    rows: list[list[Any]] = []
    for method in METHODS:
        runs = trials[method]
        cpu = median(t["cpu_seconds"] for t in runs)
        rows.append(
            [
                method,
                median(t["bytes"] for t in runs) / 1e9,
                median(t["seconds"] for t in runs),
                speed[method],
                max(t["gb_per_s"] for t in runs),
                median(paired[method]),
                cpu,
            ]
        )
    for label, seconds in (("warm", verify_warm), ("cold", verify_cold)):
        rows.append(
            [f"verify (deep, {label} cache)", checkpoint_bytes / 1e9, seconds, checkpoint_bytes / seconds / 1e9]
        )
        rows[-1] += ["", "", ""]
    headers = ["method", "GB", "seconds", "GB/s", "best GB/s", "perdure / method", "cpu s"]
    print(format_table(headers, rows))
    print(
        f"xxh3_128 in memory: {info['xxh3_128_in_memory_gb_per_s']:.2f} GB/s; files on {info['directory_filesystem']}"
    )

    ratio = median(paired["torch.save"])
    targets = [target("perdure save GB/s / torch.save GB/s", ratio, ">=", TARGET_RATIO)]
    print(format_targets(targets))
    results = {
        "gb_per_s": speed,
        "best_gb_per_s": {method: max(t["gb_per_s"] for t in trials[method]) for method in METHODS},
        "perdure_over_torch_save_best": max(t["gb_per_s"] for t in trials["perdure"])
        / max(t["gb_per_s"] for t in trials["torch.save"]),
        "perdure_over_torch_save": ratio,
        "perdure_over_torch_save_fileobj": median(paired["torch.save(fileobj)"]),
        "perdure_over_dd": median(paired["dd"]),
        "perdure_over_torch_save_of_medians": speed["perdure"] / speed["torch.save"],
        "perdure_no_crc32_over_torch_save": median(
            n["gb_per_s"] / b["gb_per_s"] for n, b in zip(trials["perdure, no zip crc32"], trials["torch.save"])
        ),
        "checkpoint_bytes": checkpoint_bytes,
        "verify_warm_seconds": verify_warm,
        "verify_cold_seconds": verify_cold,
        "verify_warm_gb_per_s": checkpoint_bytes / verify_warm / 1e9,
        "verify_cold_gb_per_s": checkpoint_bytes / verify_cold / 1e9,
        "trials": trials,
        **info,
    }
    config = {
        "model": f"{args.layers} x Linear({args.width}, {args.width}) fp32 + AdamW state (one step)",
        "repeats": args.repeats,
        "warmup_round": not args.no_warmup,
        "torch_threads": threads,
        "dd": f"bs={DD_BLOCK} conv=fsync from /dev/zero, count = ceil(tensor bytes / bs)",
        "ratio": "median over rounds of (perdure GB/s / method GB/s in the same round)",
        "page_cache": "os.sync() before and after every trial; each trial writes new files, fsynced inside the "
        "timing, deleted after; cold verification evicts the checkpoint's pages with posix_fadvise(DONTNEED)",
    }
    if note := load_note():
        print(f"WARNING: {note}")
    path = write_results(NAME, config, results, targets)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
