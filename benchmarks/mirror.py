"""A checkpoint mirror on object storage (`ckpt.mirror`, issue 35): what it costs training, and how fast it uploads.

    python benchmarks/mirror.py [--steps 60] [--interval 10] [--width 1024] [--depth 4] [--rounds 3]

A local S3 server (moto's, in its own process on 127.0.0.1, reached through AWS_ENDPOINT_URL like a real one) stands
for the store. Per round, in rotating order, the same MLP trains three times in this process with sync saves every
`interval` steps: without a mirror, with one, and without one while another process uploads checkpoint-sized files
to the same store with s3fs. Reported:
- step-time ratio: the median time of the optimizer steps taken while an upload was under way, over the median step
  of the run without a mirror (save time excluded from both);
- the same ratio for the run beside another process's plain uploads: what uploading these bytes to this store costs
  the machine without perdure (on a small machine the store's server competes for its cores), and the mirror's ratio
  over it;
- upload throughput: perdure's upload of each committed checkpoint (each file hashed against the manifest, then the
  store's own put; manifest last, then the pointers) against s3fs's own plain recursive `put` of the same directory,
  interleaved, in MB/s.
Targets: step-time ratio <= 1.10, and <= 1.10 x the plain uploads' ratio; perdure's upload >= 0.8 x the plain
upload's throughput.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import format_table, format_targets, median, setup_threads, spread, target, write_results


def start_store() -> subprocess.Popen:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-c", f"from moto.server import main; main(['-H', '127.0.0.1', '-p', '{port}'])"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        NO_PROXY="127.0.0.1",
    )
    import boto3
    from botocore.exceptions import EndpointConnectionError

    deadline = time.monotonic() + 60
    while True:
        try:
            boto3.client("s3").create_bucket(Bucket="bench")
            return server
        except EndpointConnectionError:  # the server is still starting
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.2)


def checkpoint_bytes(args: argparse.Namespace) -> int:
    """About one checkpoint of the MLP: parameters and AdamW's two moments, fp32."""
    parameters = args.depth * (args.width * args.width + args.width) + 2 * args.width + 2
    return parameters * 4 * 3


def plain_uploads(blob: Path) -> subprocess.Popen:
    """Another process putting `blob` to the store again and again with s3fs: the cost an upload of these bytes
    puts on this machine (the store's server included) without perdure."""
    code = (
        "import fsspec\n"
        "fs = fsspec.filesystem('s3', skip_instance_cache=True)\n"
        "i = 0\n"
        f"while True:\n    fs.put_file({str(blob)!r}, f'bench/beside/{{i}}.bin')\n    i += 1\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train(args: argparse.Namespace, root: Path, mirror: str | None) -> dict:
    """One training run; the time of each optimizer step, and whether an upload was under way during it."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from perdure import Runner, RunnerConfig

    class Config(RunnerConfig):
        def __init__(self):
            super().__init__()
            self.steps = args.steps
            self.ckpt.interval = args.interval
            self.ckpt.keep_latest_k = 0
            self.ckpt.mirror = mirror
            self.log.interval = 10**9
            self.dataloader.batch_size = 32
            self.workspace.root = str(root)

    steps: list[tuple[float, bool]] = []

    class MLPRunner(Runner):
        def __init__(self, config):
            super().__init__(config)
            layers = []
            for _ in range(args.depth):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            self.model = nn.Sequential(*layers, nn.Linear(args.width, 2))
            self.criterion = nn.CrossEntropyLoss()
            inputs = torch.randn(256, args.width, generator=torch.Generator().manual_seed(0))
            self.datasets["train"] = TensorDataset(inputs, (inputs[:, 0] > 0).long())
            self._tick = None

        def optimizer_step(self):
            stepped = super().optimizer_step()
            now = time.perf_counter()
            if self._tick is not None:
                uploading = bool(self.checkpoints.mirror is not None and self.checkpoints.mirror.pending())
                steps.append((now - self._tick, uploading))
            self._tick = now
            return stepped

        def save_checkpoint(self, reason):
            try:
                return super().save_checkpoint(reason)
            finally:
                self._tick = None  # the step after a save is timed from its own start, not from before the save

    runner = MLPRunner(Config())
    runner.train()
    return {"steps": steps, "run_dir": runner.run_dir.path}


def upload_throughput(run_dir: Path, rounds: int) -> dict:
    """perdure's upload of each checkpoint against s3fs's plain recursive put of the same directory."""
    from perdure.checkpoints.mirror import MirrorStore, upload_checkpoint

    root = run_dir / "checkpoints"
    names = sorted(path.name for path in root.glob("ckpt-*"))
    nbytes = sum(path.stat().st_size for name in names for path in (root / name).rglob("*") if path.is_file())
    perdure_mbs, plain_mbs = [], []
    for index in range(rounds):
        store = MirrorStore(f"s3://bench/throughput/perdure-{index}")
        plain = MirrorStore(f"s3://bench/throughput/plain-{index}")
        for first in ("perdure", "plain") if index % 2 == 0 else ("plain", "perdure"):
            started = time.perf_counter()
            for name in names:
                if first == "perdure":
                    upload_checkpoint(store, root, name)
                else:
                    plain.fs.put(str(root / name), plain.path(name), recursive=True)
            seconds = time.perf_counter() - started
            (perdure_mbs if first == "perdure" else plain_mbs).append(nbytes / seconds / 1e6)
    return {"bytes": nbytes, "checkpoints": len(names), "perdure_mb_s": perdure_mbs, "plain_mb_s": plain_mbs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    threads = setup_threads()
    server = start_store()
    try:
        ratios, during, without, beside, last_run = [], [], [], [], None
        kinds = ("plain", "mirror", "beside")
        with tempfile.TemporaryDirectory() as tmp:
            blob = Path(tmp) / "checkpoint-sized.bin"
            blob.write_bytes(os.urandom(checkpoint_bytes(args)))
            for index in range(args.rounds):
                runs = {}
                for kind in kinds[index % 3 :] + kinds[: index % 3]:
                    mirror = f"s3://bench/round-{index}" if kind == "mirror" else None
                    uploader = plain_uploads(blob) if kind == "beside" else None
                    try:
                        runs[kind] = train(args, Path(tmp) / f"{kind}-{index}", mirror)
                    finally:
                        if uploader is not None:
                            uploader.kill()
                            uploader.wait()
                uploading = [seconds for seconds, busy in runs["mirror"]["steps"] if busy]
                base = median(seconds for seconds, _ in runs["plain"]["steps"])
                if uploading:
                    during.append(median(uploading))
                    without.append(base)
                    ratios.append(median(uploading) / base)
                    beside.append(median(seconds for seconds, _ in runs["beside"]["steps"]) / base)
                last_run = runs["mirror"]["run_dir"]
            throughput = upload_throughput(last_run, args.rounds)
    finally:
        server.kill()
        server.wait()
    upload_ratios = [a / b for a, b in zip(throughput["perdure_mb_s"], throughput["plain_mb_s"])]
    over_beside = [a / b for a, b in zip(ratios, beside)]
    rows = [
        ["step time while uploading / without mirror", f"{median(ratios):.3f}", spread(ratios)],
        ["step ms while uploading", f"{1e3 * median(during):.2f}", ""],
        ["step ms without mirror", f"{1e3 * median(without):.2f}", ""],
        ["step time while another process uploads / without", f"{median(beside):.3f}", spread(beside)],
        ["mirror's step ratio / that ratio", f"{median(over_beside):.3f}", spread(over_beside)],
        ["perdure upload MB/s", f"{median(throughput['perdure_mb_s']):.1f}", spread(throughput["perdure_mb_s"])],
        ["plain s3fs put MB/s", f"{median(throughput['plain_mb_s']):.1f}", spread(throughput["plain_mb_s"])],
        ["perdure / plain throughput", f"{median(upload_ratios):.3f}", spread(upload_ratios)],
    ]
    print(format_table(["metric", "median", "range"], rows))
    targets = [
        target("step_time_ratio", median(ratios), "<=", 1.10),
        target("step_ratio_over_plain_upload_beside", median(over_beside), "<=", 1.10),
        target("upload_throughput_ratio", median(upload_ratios), ">=", 0.8),
    ]
    print(format_targets(targets))
    config = {**vars(args), "threads": threads, "checkpoint_bytes": throughput["bytes"] // throughput["checkpoints"]}
    results = {
        "step_ratio": median(ratios),
        "upload_ratio": median(upload_ratios),
        "step_ratios": ratios,
        "step_ratios_plain_upload_beside": beside,
        "step_s_uploading": during,
        "step_s_without": without,
        **throughput,
    }
    path = write_results("mirror", config, results, targets)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
