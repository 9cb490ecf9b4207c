"""Start test programs without paying for `import torch` each time: a fork server for the test suite.

Every program a test launches spent about 2.5 s of CPU importing torch (and torch._dynamo, which the first optimizer
imports) before doing anything; over hundreds of launches that was most of the suite's time on two cores. Each pytest
process therefore keeps one *zygote*: `python -m tests.zygote`, started once in the test environment, which imports
torch, torch._dynamo, numpy and perdure, never runs a tensor operation, and forks once per launch. The forked child
takes the launch's stdin/stdout/stderr (passed over a unix socket), environment, working directory and argv, reseeds
Python's and numpy's generators as a new interpreter does, and runs the program as `__main__` (`runpy`); it ends as
that interpreter would (atexit handlers; a traceback and exit 1; death by a signal).

`popen()` and `run()` replace `subprocess.Popen` / `subprocess.run`: the zygote runs `[sys.executable, "prog.py" |
"-m" module | "-c" code, ...]`, and a new interpreter runs anything else: another command, an argument they do not
know, a variable that torch or Python reads at import time set otherwise than in the zygote (TORCH*, OMP_*, ...;
PYTHONPATH, PYTHONFAULTHANDLER and PYTHONUNBUFFERED are applied in the child), CUDA visible (the GPU checks stay
faithful), or PERDURE_TEST_FRESH_PROCESSES=1 in the test's environment (every launch a new interpreter).
The child is a real process: SIGKILL and SIGTERM reach it, and its exit status comes back as from `subprocess.Popen`.
What differs from a new interpreter: /proc/PID/cmdline names the zygote, the children share one hash seed, and a
child skips the interpreter's final teardown (after its atexit handlers, with its streams flushed): an object still
alive then is not finalized, so a file the program left open loses what it never flushed."""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Read when Python, the loader, OpenMP or torch start (the zygote imported torch, torch._dynamo and numpy): a launch
# that sets one of these otherwise than the zygote got them gets a new interpreter. (Not DS_* other than
# DS_ACCELERATOR, NCCL_*, CUDA_*, TORCHFT_*, TORCHINDUCTOR_*, ...: read when a program uses them, after the fork; in a
# test's own process perdure sets DS_ACCELERATOR and CUBLAS_WORKSPACE_CONFIG, torch.compile TORCHINDUCTOR_CACHE_DIR.)
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC", "OMP_", "GOMP", "KMP_", "MKL_", "NUMPY")
IMPORT_TIME_PREFIXES += ("TORCH_", "TORCHDYNAMO", "PYTORCH")
SET_IN_THE_CHILD = ("PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED")  # `become` applies these as Python would
# DeepSpeed (~2 s to import) picks its accelerator when imported: the zygote imports it with the one perdure sets
# where CUDA is not visible (the only place the zygote forks); a launch that names another gets a new interpreter.
IMPORTED_WITH = {"DS_ACCELERATOR": "cpu"}
# Set in os.environ by an import the zygote makes too: `import deepspeed` does
# setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1") before its own imports (in the zygote as in a new interpreter), and
# torch reads it only when a program calls torch.cuda.is_available() (the child then sees the launch's environment;
# the zygote forks only where CUDA is not visible). Compared, it sent every later launch of a pytest process to a new
# interpreter once a test had imported DeepSpeed in that process (4-rank launches then cost ~15x their forked CPU).
SET_BY_IMPORTS = ("PYTORCH_NVML_BASED_CUDA_CHECK",)
FRESH_ENV = "PERDURE_TEST_FRESH_PROCESSES"
MAX_REQUEST = 1 << 20


# ---------------------------------------------------------------------------------------------------- the server


def serve(path: str) -> dict | None:
    """Answer launch requests on the unix socket `path` until the client side closes; returns only in a forked child
    (the request it is to run)."""
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer: ~1 s)
    import torch.distributed.checkpoint  # noqa: F401

    import perdure  # noqa: F401

    os.environ.update(IMPORTED_WITH)  # the child's environment replaces the zygote's
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass  # an optional dependency: the programs that need it fail alike in a new interpreter

    assert not torch.cuda.is_initialized()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")  # EOF: the pytest process is gone
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                for pidfd in children:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                return None
            if key.data == "accept":
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, 3)
                if not message or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    connection.close()
                    continue
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                gc.freeze()  # the child's collections skip what it inherits (and leave those pages shared)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    connection.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    for number, fd in enumerate(fds):
                        os.dup2(fd, number)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                socket.send_fds(connection, [json.dumps({"pid": pid}).encode()], [pidfd])
                children[pidfd] = (pid, connection)
                selector.register(pidfd, selectors.EVENT_READ, "child")
            else:  # a child ended
                pidfd = key.fd
                pid, connection = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    connection.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # nobody waits for this child any more
                connection.close()


def become(request: dict) -> None:
    """In the forked child: turn into `python program.py args` (or `python -m module args`, `python -c code args`)
    in the request's environment and directory."""
    import random
    import runpy
    import types

    import numpy

    os.chdir(request["cwd"])
    zygote_path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    os.environ.clear()
    os.environ.update(request["env"])
    own_path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[1:] = [*own_path, *(entry for entry in sys.path[1:] if entry not in zygote_path)]
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()
    if not os.environ.get("PYTHONUNBUFFERED"):  # Python's default for pipes: stdout in blocks, stderr in lines
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    random.seed()  # a new interpreter seeds both from the system's entropy
    numpy.random.seed()
    _, first, *rest = request["argv"]
    if first == "-m":
        sys.argv, sys.path[0] = ["-m", *rest[1:]], os.getcwd()
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif first == "-c":
        sys.argv, sys.path[0] = ["-c", *rest[1:]], ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(rest[0], "<string>", "exec"), main.__dict__)
    else:
        sys.argv, sys.path[0] = [first, *rest], os.path.dirname(os.path.abspath(first))
        runpy.run_path(first, run_name="__main__")


# ---------------------------------------------------------------------------------------------------- the client


class ForkedProcess:
    """What `subprocess.Popen` gives, for a program the zygote forked: pid, args, stdout / stderr (pipes, text),
    poll, wait, communicate, send_signal, kill, terminate, returncode."""

    def __init__(self, zygote: str, args: list[str], env: dict[str, str], cwd: str | None, stdout, stderr, text: bool):
        self.args = args
        self.returncode: int | None = None
        self._text = text
        ends: list[int] = []  # the child's ends, closed here once the zygote has them
        stdin = os.open(os.devnull, os.O_RDONLY)
        ends.append(stdin)
        self.stdout = self.stderr = None
        out_fd = self._stream(stdout, 1, ends)
        err_fd = out_fd if stderr == subprocess.STDOUT else self._stream(stderr, 2, ends)
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._control.connect(zygote)
            request = {"argv": args, "env": env, "cwd": cwd or os.getcwd()}
            socket.send_fds(self._control, [json.dumps(request).encode()], [stdin, out_fd, err_fd])
            message, fds, _, _ = socket.recv_fds(self._control, 4096, 1)
        finally:
            for fd in ends:
                os.close(fd)
        if not message:
            raise RuntimeError("the test zygote closed the connection instead of starting the program")
        self.pid = json.loads(message)["pid"]
        self._pidfd = fds[0]
        self._output: dict[int, list[bytes]] = {}  # what communicate() read, by stream

    def _stream(self, spec, number: int, ends: list[int]) -> int:
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            ends.append(write)
            stream = open(read, "r" if self._text else "rb")  # noqa: SIM115  (closed with the process)
            if number == 1:
                self.stdout = stream
            else:
                self.stderr = stream
            return write
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
            ends.append(fd)
            return fd
        if spec is None:
            return number  # inherit this process's own
        fd = spec if isinstance(spec, int) else spec.fileno()
        return fd

    def _receive(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._control.settimeout(timeout)
        try:
            message = self._control.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        if not message:
            raise RuntimeError(f"the test zygote died before program {self.args[1]} (pid {self.pid}) ended")
        self.returncode = json.loads(message)["returncode"]
        self._control.close()
        os.close(self._pidfd)

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                pass  # it ended and its status is on the way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input=None, timeout: float | None = None):
        """Read stdout and stderr to their ends, then wait; as Popen.communicate (no input; a second call after the
        end gives the same output again)."""
        assert input is None, "the zygote's programs read no stdin"
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for stream in (self.stdout, self.stderr):
                if stream is not None and not stream.closed:
                    self._output.setdefault(id(stream), [])
                    selector.register(stream.fileno(), selectors.EVENT_READ, stream)
            while selector.get_map():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(remaining):
                    data = os.read(key.fd, 65536)
                    if data:
                        self._output[id(key.data)].append(data)
                    else:
                        selector.unregister(key.fd)
                        key.data.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        outputs = []
        for stream in (self.stdout, self.stderr):
            data = None if stream is None else b"".join(self._output.get(id(stream), []))
            outputs.append(_decode(data) if self._text and data is not None else data)
        return tuple(outputs)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _decode(data: bytes) -> str:
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")  # text=True's universal newlines


_ZYGOTE: tuple[subprocess.Popen, str, dict[str, str]] | None = None
ENVIRONMENT_AT_START = dict(os.environ)  # imported while pytest collects, before any test runs


def _zygote() -> tuple[str, dict[str, str]]:
    """This pytest process's zygote (started at its first launch): its socket and environment, the test environment
    as it was before any test ran (a test may set variables in its own process while it runs)."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE[0].poll() is not None:
        from tests.runs import REPO, environment

        env = environment(base=ENVIRONMENT_AT_START)
        path = os.path.join(tempfile.mkdtemp(prefix="perdure-zygote-"), "socket")
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", path],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,  # its end of this pipe closes when this process dies: the zygote then exits
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = process.stdout.readline()
        while ready and ready.strip() != "ready":  # what an import logged first (DeepSpeed's accelerator line)
            ready = process.stdout.readline()
        if ready.strip() != "ready":
            process.kill()
            raise RuntimeError(f"the test zygote did not start (it printed {ready!r}; its error is above)")
        atexit.register(_stop, process, path)
        _ZYGOTE = (process, path, env)
    return _ZYGOTE[1], _ZYGOTE[2]


def _stop(process: subprocess.Popen, path: str) -> None:
    process.stdin.close()  # the zygote kills the children still running and exits
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _forkable(args, env: dict[str, str] | None, kwargs: dict) -> bool:
    if os.environ.get(FRESH_ENV) == "1" or set(kwargs) - {"stdout", "stderr", "text", "cwd"}:
        return False
    if not (isinstance(args, list | tuple) and len(args) >= 2 and args[0] == sys.executable):
        return False
    if not (str(args[1]).endswith(".py") or (args[1] in ("-m", "-c") and len(args) >= 3)):
        return False
    import torch

    return not torch.cuda.is_available()


# Launches this process gave a new interpreter because of a variable, by variable: tests/cpu_report.py names them with
# the test that launched them (a variable a test leaves set in its pytest process costs every later launch ~2.5 s).
NEW_INTERPRETERS_BY_VARIABLE: dict[str, int] = {}


def _import_time_differences(env: dict[str, str], zygote_env: dict[str, str]) -> list[str]:
    """The variables that `env` sets otherwise than the zygote was started or imported with (none: it can fork)."""
    keys = {key for key in (*env, *zygote_env) if key.startswith(IMPORT_TIME_PREFIXES)}
    keys -= {*SET_IN_THE_CHILD, *SET_BY_IMPORTS}
    differing = {key for key, value in IMPORTED_WITH.items() if env.get(key, value) != value}
    return sorted(differing | {key for key in keys if env.get(key) != zygote_env.get(key)})


def popen(args, *, env: dict[str, str] | None = None, **kwargs) -> ForkedProcess | subprocess.Popen:
    """`subprocess.Popen(args, env=..., stdout=..., stderr=..., text=..., cwd=...)`, forked from the zygote when it
    can be (see the module's docstring)."""
    if _forkable(args, env, kwargs):
        path, zygote_env = _zygote()
        env = dict(os.environ if env is None else env)
        differing = _import_time_differences(env, zygote_env)
        for key in differing:
            NEW_INTERPRETERS_BY_VARIABLE[key] = NEW_INTERPRETERS_BY_VARIABLE.get(key, 0) + 1
        if not differing:
            cwd = kwargs.get("cwd")
            return ForkedProcess(
                path,
                [str(arg) for arg in args],
                env,
                None if cwd is None else str(cwd),
                kwargs.get("stdout"),
                kwargs.get("stderr"),
                bool(kwargs.get("text")),
            )
    return subprocess.Popen(args, env=env, **kwargs)


def run(
    args, *, env: dict[str, str] | None = None, capture_output: bool = False, timeout: float | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """`subprocess.run(args, env=..., capture_output=..., text=..., timeout=..., cwd=...)`, the program forked from
    the zygote when it can be."""
    if not _forkable(args, env, kwargs):
        return subprocess.run(args, env=env, capture_output=capture_output, timeout=timeout, **kwargs)
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process = popen(args, env=env, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


# ---------------------------------------------------------------------------------------------------- the end

_CHILD_EXIT: list[int | str] = []  # in a forked child: the status its interpreter would exit with, once known


def _end_without_teardown() -> None:
    """The last atexit handler of a forked child (registered before the zygote's imports): every other handler has
    run and the non-daemon threads are joined, as in a new interpreter; what remains is tearing down the modules the
    zygote imported, which writes to every inherited page (~1 s a launch). The child flushes its streams and exits
    with the status that interpreter would have, without it."""
    if not _CHILD_EXIT:
        return  # the zygote itself, or a child that has not run its program
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # closed, or a broken pipe: the interpreter would not have written it either
    if _CHILD_EXIT[0] == "SIGINT":  # an uncaught KeyboardInterrupt: Python ends by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(int(_CHILD_EXIT[0]) & 0xFF)


def _exit_status(stop: SystemExit) -> int:
    """The status `python program.py` exits with for this SystemExit (its message, if any, is printed by Python)."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


if __name__ == "__main__":
    atexit.register(_end_without_teardown)
    child_request = serve(sys.argv[1])
    if child_request is not None:
        try:
            become(child_request)
        except SystemExit as stop:
            _CHILD_EXIT.append(_exit_status(stop))
            raise
        except KeyboardInterrupt:
            _CHILD_EXIT.append("SIGINT")
            raise
        except BaseException:
            _CHILD_EXIT.append(1)
            raise
        _CHILD_EXIT.append(0)
