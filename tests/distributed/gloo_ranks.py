"""Run a plain-torch function on several gloo ranks and collect what each rank returns.

For tests of torch-level rules (how DDP reduces, what a collective sums) that need no runner and no workspace:
cheaper than launching a training script per rank, and every rank's exception comes back with its traceback. Each
rank is forked from the test zygote (tests/zygote.py: torch already imported) and runs this module as its program:
`python -m tests.distributed.gloo_ranks REQUEST RANK`, where REQUEST is a pickle this test process wrote (the
function's module file and name, the world size, the port and the arguments); the rank pickles its outcome beside it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import zygote
from tests.runs import REPO, environment, free_port


def run_on_gloo_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` processes joined in one gloo group; the return values in rank
    order (they must pickle). `fn` must be importable by name (a module-level function)."""
    module = sys.modules[fn.__module__]
    with tempfile.TemporaryDirectory(prefix="gloo-ranks-") as directory:
        request = Path(directory) / "request.pkl"
        request.write_bytes(
            pickle.dumps((str(module.__file__), fn.__module__, fn.__qualname__, world_size, free_port(), args))
        )
        processes = [
            zygote.popen(
                [sys.executable, "-m", "tests.distributed.gloo_ranks", str(request), str(rank)],
                env=environment(OMP_NUM_THREADS="1"),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world_size)
        ]
        deadline = time.monotonic() + timeout
        try:
            outputs = [process.communicate(timeout=max(0.0, deadline - time.monotonic()))[0] for process in processes]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the ranks did not finish within {timeout} s") from None
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        results = []
        for rank, output in enumerate(outputs):
            outcome = Path(directory) / f"rank-{rank}.pkl"
            if not outcome.exists():
                code = processes[rank].returncode
                raise AssertionError(f"rank {rank} ended without a result (exit {code}):\n{output}")
            status, value = pickle.loads(outcome.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    return results


def _rank_main(request: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    file, module_name, qualname, world_size, port, args = pickle.loads(request.read_bytes())
    torch.set_num_threads(1)
    try:
        sys.path.insert(0, os.path.dirname(file))  # where pytest found the test module
        fn = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            outcome = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:
        outcome = ("error", traceback.format_exc())
    (request.parent / f"rank-{rank}.pkl").write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), int(sys.argv[2]))
