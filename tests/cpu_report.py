"""What each test costs in CPU seconds, whatever else the machine runs: `pytest -p tests.cpu_report` (`make test`
loads it) writes one JSON line per test to `$PERDURE_TEST_CPU_REPORT` (by default a file in the temporary directory,
named at the end of the run), and prints the files and tests that cost most after pytest's own summary;
`python -m tests.cpu_report FILE [N]` prints them again.

Wall time is a poor guide on a loaded machine: two workers share two cores with every rank, writer process and
server their tests start, so a test's duration mostly says what ran beside it. CPU time does not. A test's CPU is
its pytest process's own, plus its reaped children's (`RUSAGE_CHILDREN`: new interpreters), plus what the zygote's
children used (`/proc/<zygote>/stat`: cutime and cstime grow as the zygote reaps a launch, the launch's own reaped
children included). A launch still running when the test ends counts in the next test of that worker."""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from tests import zygote

TICKS = os.sysconf("SC_CLK_TCK")


def _zygote_children_seconds() -> float:
    if zygote._ZYGOTE is None:
        return 0.0
    try:
        fields = Path(f"/proc/{zygote._ZYGOTE[0].pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / TICKS  # cutime, cstime (fields 16 and 17 of proc(5))


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _zygote_children_seconds()


REPORT = "PERDURE_TEST_CPU_REPORT"


def pytest_configure(config: pytest.Config) -> None:
    """In the controller (or a run without workers): one report file for the session; workers inherit its name."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if REPORT not in os.environ:
        os.environ[REPORT] = os.path.join(tempfile.gettempdir(), f"perdure-test-cpu-{os.getpid()}.jsonl")
    Path(os.environ[REPORT]).write_text("")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or not Path(os.environ[REPORT]).stat().st_size:
        return
    terminalreporter.section("CPU seconds (tests/cpu_report.py)")
    summarize(Path(os.environ[REPORT]), 15, write=terminalreporter.write_line)
    terminalreporter.write_line(f"every test: {os.environ[REPORT]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_seconds(), time.monotonic()
    launched = dict(zygote.NEW_INTERPRETERS_BY_VARIABLE)
    yield
    record = {"test": item.nodeid, "cpu": round(_cpu_seconds() - cpu, 2), "wall": round(time.monotonic() - wall, 2)}
    new = {key: n - launched.get(key, 0) for key, n in zygote.NEW_INTERPRETERS_BY_VARIABLE.items()}
    if any(new.values()):  # launches a variable set otherwise than in the zygote sent to a new interpreter
        record["new_interpreters"] = {key: n for key, n in new.items() if n}
    path = Path(os.environ[REPORT])
    with path.open("a") as report:
        report.write(json.dumps(record) + "\n")


def summarize(path: Path, top: int = 40, write=print) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_file: Counter[str] = Counter()
    wall_by_file: Counter[str] = Counter()
    for record in records:
        by_file[record["test"].split("::")[0]] += record["cpu"]
        wall_by_file[record["test"].split("::")[0]] += record["wall"]
    total = sum(record["cpu"] for record in records)
    write(f"{len(records)} tests, {total:.0f} CPU seconds ({total / 60:.1f} CPU minutes)")
    write("files by CPU seconds (wall seconds beside):")
    for name, seconds in by_file.most_common(top):
        write(f"{seconds:8.1f} {wall_by_file[name]:8.1f}  {name}")
    write("tests by CPU seconds (wall seconds beside):")
    for record in sorted(records, key=lambda record: -record["cpu"])[:top]:
        write(f"{record['cpu']:8.1f} {record['wall']:8.1f}  {record['test']}")
    # tests/zygote.py: a launch whose environment sets a variable read at import time otherwise than the zygote's
    # gets a new interpreter; a variable a test left set in its pytest process does that to every later launch.
    by_variable: Counter[str] = Counter()
    first: dict[str, str] = {}
    for record in records:
        for key, n in record.get("new_interpreters", {}).items():
            by_variable[key] += n
            first.setdefault(key, record["test"])
    if by_variable:
        write("launches given a new interpreter, by the variable that differed from the zygote's (first test):")
        for key, n in by_variable.most_common():
            write(f"{n:8d}  {key}  ({first[key]})")


if __name__ == "__main__":
    summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40)
