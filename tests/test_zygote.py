"""The test suite's fork server (tests/zygote.py) behaves as `subprocess` does for the programs the tests launch: exit
statuses, signals, output, environment, argv, fresh generators, and a new interpreter where it cannot be faithful."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.runs import environment as launch_environment


def environment(**extra: str) -> dict[str, str]:
    """The test environment as it was before any test ran (what the zygote has): what other tests set in this
    process (and would send a launch to a new interpreter) does not decide these tests."""
    return launch_environment(base=zygote.ENVIRONMENT_AT_START, **extra)


PROGRAM = """
import json, os, random, sys
import numpy
print(json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "only_here": os.environ.get("ONLY_HERE"), "random": random.random(), "numpy": float(numpy.random.rand()),
}))
sys.stderr.write("to stderr\\n")
code = os.environ.get("EXIT_WITH")
if code == "raise":
    raise ValueError("raised by the program")
if code == "sleep":
    print("sleeping", flush=True)
    import time
    time.sleep(60)
sys.exit(int(code or 0))
"""


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return path


def launch(program, *args, **env) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, str(program), *args], env=environment(**env), capture_output=True, text=True)


@pytest.mark.timeout(60)
def test_a_forked_program_sees_its_own_argv_environment_and_directory(program, tmp_path):
    import json

    process = zygote.popen(
        [sys.executable, str(program), "a", "b"],
        env=environment(ONLY_HERE="yes"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert isinstance(process, zygote.ForkedProcess)
    out, err = process.communicate(timeout=30)
    seen = json.loads(out)
    assert process.returncode == 0 and err == "to stderr\n"
    assert seen["name"] == "__main__" and seen["argv"] == [str(program), "a", "b"]
    assert seen["path0"] == str(program.parent) and seen["cwd"] == str(tmp_path) and seen["only_here"] == "yes"
    assert json.loads(launch(program).stdout)["only_here"] is None  # nothing carried over from the previous child


@pytest.mark.timeout(60)
def test_each_child_draws_from_fresh_generators(program):
    import json

    first, second = (json.loads(launch(program).stdout) for _ in range(2))
    assert first["random"] != second["random"] and first["numpy"] != second["numpy"]


@pytest.mark.timeout(60)
def test_exit_codes_and_a_traceback_come_back_as_from_a_new_interpreter(program):
    assert launch(program, EXIT_WITH="3").returncode == 3
    raised = launch(program, EXIT_WITH="raise")
    assert raised.returncode == 1
    assert "Traceback" in raised.stderr and "ValueError: raised by the program" in raised.stderr


ENDING = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
print("buffered", end="")
sys.stderr.write("stderr unflushed")
how = os.environ["END_WITH"]
if how == "message":
    sys.exit("a message")
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(how))
"""


@pytest.mark.timeout(60)
def test_a_program_ends_as_in_a_new_interpreter(tmp_path):
    """The forked child skips the teardown of the zygote's modules, nothing else: the program's atexit handlers and
    threads finish, its buffered output is written, and its status and last words are those `python ending.py`
    has (sys.exit(-1) is 255, a message is printed and exits 1, an uncaught KeyboardInterrupt dies of SIGINT)."""
    path = tmp_path / "ending.py"
    path.write_text(ENDING)
    quiet = "stderr unflushed"
    expected = {"0": (0, quiet), "7": (7, quiet), "-1": (255, quiet), "message": (1, "a message")}
    expected["interrupt"] = (-signal.SIGINT, "KeyboardInterrupt")
    for how, (status, last_line) in expected.items():
        env = {key: value for key, value in environment(END_WITH=how).items() if key != "PYTHONUNBUFFERED"}
        forked = zygote.popen([sys.executable, str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert isinstance(forked, zygote.ForkedProcess)
        out, err = forked.communicate(timeout=30)
        assert forked.returncode == status, (how, err)
        assert out == b"bufferedthread joined\natexit ran\n", (how, out)
        assert err.startswith(quiet.encode()) and err.decode().splitlines()[-1].endswith(last_line), (how, err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_kills_the_forked_program_and_its_status_says_so(program, signum):
    process = zygote.popen(
        [sys.executable, str(program)], env=environment(EXIT_WITH="sleep"), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().startswith("{") and process.stdout.readline() == "sleeping\n"
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.send_signal(signum)
    assert process.wait(timeout=30) == -signum
    process.kill()  # after the end: nothing happens, as with Popen


@pytest.mark.timeout(60)
def test_communicate_times_out_and_the_program_can_still_be_killed(program):
    process = zygote.popen(
        [sys.executable, str(program)], env=environment(EXIT_WITH="sleep"), stdout=subprocess.PIPE, text=True
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=1)
    assert time.monotonic() - started < 10
    process.kill()
    out, _ = process.communicate(timeout=30)
    assert "sleeping" in out and process.returncode == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_modules_and_code_run_as_with_dash_m_and_dash_c():
    module = zygote.run(
        [sys.executable, "-m", "json.tool", "--help"], env=environment(), capture_output=True, text=True
    )
    assert module.returncode == 0 and "json.tool" in module.stdout
    code = zygote.run(
        [sys.executable, "-c", "import sys; print(__name__, sys.argv)", "x"],
        env=environment(),
        capture_output=True,
        text=True,
    )
    assert code.returncode == 0 and code.stdout == "__main__ ['-c', 'x']\n"


@pytest.mark.timeout(120)
def test_what_the_zygote_cannot_run_faithfully_gets_a_new_interpreter(program, monkeypatch):
    command = [sys.executable, str(program)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    launched = [
        zygote.popen(command, env=environment(TORCH_LOGS="+dynamo"), **quiet),  # torch reads it at import
        zygote.popen(command, env=environment(DS_ACCELERATOR="cuda"), **quiet),  # not what DeepSpeed was imported with
        zygote.popen(command, env=environment(), start_new_session=True, **quiet),  # an argument it does not take
        zygote.popen(["true"], env=environment()),  # not a Python program
    ]
    monkeypatch.setenv(zygote.FRESH_ENV, "1")
    launched.append(zygote.popen(command, env=environment(), **quiet))
    for process in launched:
        assert isinstance(process, subprocess.Popen)
        assert process.wait(timeout=60) == 0


@pytest.mark.timeout(60)
def test_variables_read_after_the_fork_do_not_cost_the_zygote(program):
    """perdure sets DS_ACCELERATOR and CUBLAS_WORKSPACE_CONFIG in a test's own process, torch.compile sets
    TORCHINDUCTOR_CACHE_DIR, `import deepspeed` PYTORCH_NVML_BASED_CUDA_CHECK, tests set TORCHFT_*: nothing reads them
    before the fork, so such launches are forked."""
    later = {"DS_ACCELERATOR": "cpu", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHFT_X": "1"}
    later["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/torchinductor_x"
    later["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    process = zygote.popen([sys.executable, str(program)], env=environment(**later), stdout=subprocess.DEVNULL)
    assert isinstance(process, zygote.ForkedProcess)
    assert process.wait(timeout=30) == 0
