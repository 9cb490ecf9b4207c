"""The kill watch against exit handlers registered after it: the real C `exit()` from a native call on a thread.

`abort` registered with `__cxa_atexit` after the watch stands for a C++ static first built after `arm()` (its
destructor runs first at exit): without `rearm()` the process dies by it; with it, the watch parks the exiting thread
first and the process ends with KILLED_EXIT_CODE having run `on_kill`. A normal exit with several registered pairs
returns at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from perdure.ft.kill_watch import KILLED_EXIT_CODE
from tests.runs import environment

SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    from perdure.ft.kill_watch import KillWatch

    mode = sys.argv[1]
    libc = ctypes.CDLL(None)
    watch = KillWatch(lambda: print("on_kill ran", flush=True)).arm()
    if mode in ("exit", "rearmed-exit"):  # a handler registered after the watch: it runs first at exit
        libc["__cxa_atexit"](ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    if mode.startswith("rearmed"):
        watch.rearm()
        watch.rearm()
    if mode.endswith("exit"):
        threading.Thread(target=libc.exit, args=(1,)).start()  # a native exit on another thread, as torchft's
        time.sleep(60)
    print("returned normally", flush=True)  # a normal exit: Python's atexit disarms, the C pairs return at once
    """
)


def run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=environment(), capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.timeout(120)
def test_a_handler_registered_after_the_watch_runs_first_unless_the_watch_is_rearmed():
    unarmed = run("exit")
    assert unarmed.returncode == -signal.SIGABRT and "on_kill ran" not in unarmed.stdout, unarmed
    rearmed = run("rearmed-exit")
    assert rearmed.returncode == KILLED_EXIT_CODE and "on_kill ran" in rearmed.stdout, rearmed


@pytest.mark.timeout(120)
def test_a_normal_exit_after_rearming_returns_at_once():
    done = run("rearmed")
    assert done.returncode == 0 and done.stdout == "returned normally\n", done
