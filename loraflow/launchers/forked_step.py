"""A step program of the launching process's own environment, started as a fork of that process.

A step program is ``python -m loraflow.steps.STAGE ...`` in its stage's environment. When that
environment is the one the launching process runs in (on an Airflow worker of the control
environment: validate_data, gate, publish, report), a new interpreter would import again what the
task process has already imported: the GCS client library (about 0.6 s on 2 cores), pydantic and
loraflow's spec models (0.3 s). Forked from the task process, the step starts with them. That was
most of a light step's time: the gate and the report of a cached re-run took 1.2 and 0.8 s as new
interpreters, with 0.3 s and 0.03 s of their own work (docs/benchmarks.md, section 6).

The child is made to look like a new step program to everything the step can see: its own process
group; stdin from /dev/null, stdout and stderr into the launcher's pipe; exactly the launcher's
environment variables (``step_environment``), cwd and argv; the signal handlers Python starts with
and an empty signal mask; none of the task's ``atexit`` or logging handlers; warnings not captured
by logging; a GCS client of its own (``loraflow.storage.gcs`` drops the parent's at fork, so no
HTTP connection is shared). It is tied to the launching process as the supervisor ties an exec'd
step (``step_supervisor.py``): when every copy of the tether's write end is gone, it kills its
process group. It always ends with ``os._exit``: it never returns into the task's code.

It forks only from a process with one thread, counted by the kernel (a lock another thread holds at
the fork would stay held in the child forever), and only for ``-m MODULE`` command lines; anything
else, ``LORAFLOW_FORK_STEPS=0`` in the launching process's environment, or a fork that fails (the
launcher then says so in the step's log), is exec'd as before.
What the child shares with the task beyond that: what is already imported (a module whose import
read an environment variable outside the step's keeps the task's value), and the task's other open
files, left open and unused (closing them under the Python objects that own them could later close
a descriptor the step reuses).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, NoReturn

from loraflow.launchers.step_supervisor import kill_group_when_launcher_dies

__all__ = ["ForkedStep", "fork_target"]

#: ``LORAFLOW_FORK_STEPS=0`` (or ``false``/``no``/``off``) in the launching process: exec every step.
SWITCH = "LORAFLOW_FORK_STEPS"


def fork_target(argv: Sequence[str]) -> str | None:
    """The module to run in a fork of this process, or None when ``argv`` must be exec'd: it is not
    ``PYTHON -m MODULE ...`` with PYTHON this process's own environment's interpreter, this process
    has other threads or ignores SIGCHLD, or forking is switched off."""
    if os.environ.get(SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return None
    if len(argv) < 3 or argv[1] != "-m" or _threads() != 1:
        return None
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:  # children are reaped unseen: no exit status
        return None
    try:
        same = Path(argv[0]).absolute().parent.parent.resolve() == Path(sys.prefix).resolve()
    except OSError:
        return None
    return argv[2] if same else None


def _threads() -> int:
    """This process's threads as the kernel counts them: native ones (a BLAS pool, gRPC) included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class ForkedStep:
    """The child, with the part of ``subprocess.Popen``'s interface the local launcher uses."""

    def __init__(self, pid: int, stdout: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, module: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, tether: int, keep_from_child: int
    ) -> ForkedStep:
        """Fork; the child runs ``module`` with ``argv[3:]`` as its arguments. ``tether`` is the read end
        of the launcher's tether; ``keep_from_child`` (its write end) is closed in the child."""
        read, write = os.pipe()
        try:
            pid = os.fork()
        except BaseException:
            os.close(read)
            os.close(write)
            raise
        if pid == 0:
            _child(module, list(argv[3:]), dict(env), cwd, write, tether, (read, keep_from_child))
        os.close(write)
        with contextlib.suppress(OSError):  # the group exists when start returns, whichever side runs first
            os.setpgid(pid, pid)
        return cls(pid, open(read, encoding="utf-8", errors="replace", buffering=1))

    def poll(self) -> int | None:
        with self._lock:  # run() waits in one thread while on_kill may poll in another
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, negative for a signal (as ``Popen.wait``); ``subprocess.TimeoutExpired`` after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is None:  # block until it has ended; poll() reaps it
                with contextlib.suppress(ChildProcessError):  # the other thread reaped it first
                    os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            elif time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"step process {self.pid}", timeout or 0)
            else:
                time.sleep(0.05)
        return rc


def _child(
    module: str, args: list[str], env: dict[str, str], cwd: str, out: int, tether: int, parents: tuple[int, ...]
) -> NoReturn:
    """The forked process: never returns into the task's code, whatever happens."""
    status = 1
    try:
        for fd in parents:  # the launcher's ends of the pipes
            os.close(fd)
        os.setpgid(0, 0)
        _fresh_process_state(env, cwd, out)
        threading.Thread(target=kill_group_when_launcher_dies, args=(tether,), daemon=True).start()
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0  # the module returned: a normal end of a program
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(status)


_INHERITED: list[object] = []

#: The handlers Python sets as it starts; every other signal has the default action.
_AT_START: dict[int, Callable[[int, FrameType | None], Any] | int] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}


def _fresh_process_state(env: dict[str, str], cwd: str, out: int) -> None:
    """What a fresh interpreter would have, where the step could tell the difference."""
    # The task's stream objects own fds 0-2: dropped, they would close the step's own 0-2 under it.
    _INHERITED.extend((sys.stdin, sys.stdout, sys.stderr))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, _AT_START.get(signum, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    atexit._clear()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    logging.captureWarnings(False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends a program with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
