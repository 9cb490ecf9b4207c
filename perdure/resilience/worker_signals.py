"""DataLoader workers leave the job's preemption signals to the training process.

SLURM (preemption, `scancel`, the time limit), torchrun (which signals each rank's process group) and most launchers
signal every process of the job, DataLoader workers included. torch's worker dies of a SIGTERM that its parent did not
send, and the training process then raises `DataLoader worker (pid ...) is killed by signal: Terminated` from its
SIGCHLD handler, wherever it is: the run fails without its preemption checkpoint. Ignoring SIGTERM in the worker is
not enough either: torch and multiprocessing stop a worker that is still alive at shutdown (or at interpreter exit)
with a SIGTERM of the parent's, and an ignoring worker would hold that exit forever.

So a worker blocks SIGTERM, SIGUSR1 and SIGINT, and one thread of its own takes them with `sigwaitinfo`, which names
the sender: a SIGTERM from the worker's parent (the loader stopping it) ends the worker at once, as torch's own handler
does; any other is dropped. The training process alone decides: it stops at an agreed step boundary, saves, and shuts
its loaders down the normal way (the workers exit on the loader's sentinel). The workers need not survive beyond
that, and never outlive the training process for long: torch's worker loop exits when its parent is gone, and the
launcher's SIGKILL after its grace window reaches them too. Processes a worker starts inherit the blocked signals, so a
decoder it runs finishes its sample instead of failing it.

Why not the other way round (let the workers die and count that death as the stop while one is pending)? The death
races the training process's own signal (torchrun and `srun` signal processes one after the other, in no set order),
the SIGCHLD error surfaces at any bytecode of the step, and the batches the dead workers held are gone, so the step
in flight cannot finish on that rank while the other ranks wait for it in a collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from perdure.resilience.signals import PREEMPTION_SIGNALS


def leave_signals_to_parent(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: block the preemption signals in this worker and start the thread that takes
    them (see the module's docstring). Does nothing where Python has no `sigwaitinfo` (not Linux)."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    threading.Thread(target=_take_signals, name=f"perdure-worker-{worker_id}-signals", daemon=True).start()


def _take_signals() -> None:
    while True:
        received = signal.sigwaitinfo(PREEMPTION_SIGNALS)
        if received.si_signo == signal.SIGTERM and received.si_pid == os.getppid():
            os._exit(0)  # the loader (or multiprocessing at exit) stops this worker; torch's handler does the same


@contextlib.contextmanager
def preemption_signals_blocked() -> Iterator[None]:
    """Block the preemption signals in this thread while DataLoader workers (or the checkpoint writer process) start:
    a process forked (or spawned) now inherits them blocked, so a group signal that lands before a worker's
    `worker_init_fn` runs waits for the thread that drops it, instead of killing the worker through torch's handler.
    This thread gets its own pending signal when the block ends; none is lost."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
