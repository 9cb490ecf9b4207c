"""DCP's own checkpoint process (`ckpt.async_mode=process` with several ranks) after a save of it failed.

`dcp.async_save(..., async_checkpointer_type=PROCESS)` keeps one background process per rank for the life of the
training process, joined to the other ranks' by a gloo group of their own, in a module global of torch's
(`_CHECKPOINT_PROCESS`). Once one of them dies (the out-of-memory killer, a signal from outside), torch never replaces
it: every later save of that rank fails with `Checkpoint background process is dead`, and the other ranks' processes,
whose group lost a member, fail theirs. Here a failed save takes this rank's process down and clears the global, so
that the next save starts a new one on every rank (DCP fails a save on every rank together, so every rank does this
after the same save; a new set agrees on a fresh port through the training's own group).

A process that dies while it is starting is another matter: the other ranks' processes wait for it in their process
group's rendezvous, for torch's 30 minutes, and nothing here can stop them. That ends the run at once, with what
happened, so that torchrun stops the other ranks and a rerun starts afresh.

It also says what happened: the errors torch reports (`RuntimeError: Checkpoint background process is dead. Exit code:
None` on the rank whose process died, a gloo `Connection reset by peer` on the others) are not I/O errors, and would
otherwise read as state that cannot be serialized, which would end the run.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.process
import pickle
import re
from multiprocessing.context import SpawnProcess

from perdure.checkpoints.save_errors import io_cause, killed_by
from perdure.errors import CheckpointSaveError, CheckpointStateError
from perdure.private_api import dcp_checkpoint_process, dcp_executor_holds_process, dcp_forget_checkpoint_process

# What sending the state to the process raises for an object that cannot be pickled: the state's fault, for good.
PICKLING_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


def replace_after_failure(error: BaseException, rank: int) -> BaseException:
    """Stop this rank's DCP checkpoint process after a failed save, so the next save starts a new one. Returns the
    error to report: a `CheckpointSaveError` naming the process when it died or failed on its own (training may go
    on), else `error` itself (an I/O error, or state that cannot be pickled)."""
    if not dcp_executor_holds_process():  # a torch without it: nothing to replace
        return error
    process = dcp_checkpoint_process()
    if process is None:  # this save was starting it (the first save, or the one after a replacement)
        return _start_failed(error, rank)
    dcp_forget_checkpoint_process()
    # One that died closed its pipe before the kernel had reaped it (torch saw `Exit code: None`): a second to finish.
    process.join(timeout=1.0)
    if not process.is_alive():
        how = f"was killed by {killer}" if (killer := killed_by(process.exitcode)) else f"exited ({process.exitcode})"
        return CheckpointSaveError(
            f"DCP's checkpoint process of rank {rank} (pid {process.pid}) {how}; the next save starts a new one on "
            "every rank"
        )
    process.kill()  # alive, but its group may have lost a member: it could never save again
    process.join(timeout=30)
    if io_cause(error) is not None or isinstance(error, PICKLING_ERRORS):
        return error
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return CheckpointSaveError(
        f"DCP's checkpoint process of rank {rank} failed ({type(error).__name__}: {first[:300]}); when another rank's "
        "checkpoint process died, that rank's output says so. The next save starts a new one on every rank"
    )


def _start_failed(error: BaseException, rank: int) -> CheckpointStateError:
    """DCP's checkpoint process of this rank died (or failed) while it was starting. The other ranks' processes are
    then inside their process group's rendezvous, waiting for this one, with torch's 30 minutes and nothing that can
    stop them from here: no save of this attempt can work, so the run stops (torchrun then stops the other ranks) and
    its rerun starts new processes. Also a failed agreement on the new processes' port lands here (every rank)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    code = re.search(r"Exit code: (-?\d+)", first)
    killer = killed_by(int(code.group(1)) if code else _reaped_exit_code())
    how = f"was killed by {killer}" if killer else f"failed ({type(error).__name__}: {first[:300]})"
    return CheckpointStateError(
        f"DCP's checkpoint process of rank {rank} {how} while it was starting. The other ranks' checkpoint processes "
        "wait for it (torch gives them 30 minutes), so no save can work in this attempt and the run stops here. Run it "
        "again: it continues from its last committed checkpoint (or use --ckpt.async_mode thread, which starts no "
        "process)"
    )


def _reaped_exit_code() -> int | None:
    """The exit status of the starting process torch lost. torch reads `Exit code: None` when the process's pipe
    closed before the kernel let it be reaped; it is then one of multiprocessing's own spawned children that has
    ended (its sentinel is ready), and has its status a moment later. None unless exactly one has ended."""
    # multiprocessing's private set of live children, which typeshed does not list.
    children = list(multiprocessing.process._children)  # type: ignore[attr-defined]
    spawned = [child for child in children if isinstance(child, SpawnProcess)]
    ready = multiprocessing.connection.wait([child.sentinel for child in spawned], timeout=0)
    ended = [child for child in spawned if child.sentinel in ready]
    if len(ended) != 1:
        return None
    ended[0].join(timeout=1.0)
    return ended[0].exitcode
