"""A tiny job (not a perdure program) for the dispatcher tests: it records what it was given, sleeps, and exits.

  ECHO_LOG    append one JSON line per event: {"event", "job", "cuda", "argv", "pid"}
  ECHO_SLEEP  seconds to sleep before exiting (default 0)
  ECHO_EXIT   exit status (default 0)
SIGTERM: records it and exits 143, like a perdure program that saved.
"""

import json
import os
import signal
import sys
import time


def record(event: str) -> None:
    line = {
        "event": event,
        "job": os.environ.get("PERDURE_SWEEP_JOB"),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "argv": sys.argv[1:],
        "pid": os.getpid(),
    }
    with open(os.environ["ECHO_LOG"], "a") as log:
        log.write(json.dumps(line) + "\n")


def on_term(signum, frame):
    record("SIGTERM")
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
record("start")
time.sleep(float(os.environ.get("ECHO_SLEEP", "0")))
record("end")
sys.exit(int(os.environ.get("ECHO_EXIT", "0")))
