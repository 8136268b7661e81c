"""How a step program is started. Here: the local launcher (a subprocess in the stage's venv, or a fork
of the task process where that venv is the task's own: ``loraflow/launchers/forked_step.py``).

Vertex AI and GKE launchers start the stage's image with the same argv (Vertex AI:
``loraflow.launchers.vertex``); the local launcher is what runs the tiny pipeline on one machine.

When the task process dies without ``on_kill`` (a lost worker, the OOM killer, SIGKILL): a local step
dies with it (``loraflow/launchers/step_supervisor.py``). A Vertex AI job or GKE JobSet keeps running, since
nothing is left to cancel it; the task's retry finds it by its deterministic identity
(``loraflow.launchers.vertex_job.JobIdentity``: DAG, run, stage, cache key) and reattaches instead of submitting a
second one, so that job stays the stage's only writer. Only a failed or cancelled job is replaced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from loraflow.errors import StepError
from loraflow.launchers.base import STEP_ENV, Launcher, LineSink, WorkloadSink, ignore_workload
from loraflow.launchers.credentials import Redactor
from loraflow.launchers.environments import REPO_ROOT
from loraflow.launchers.forked_step import ForkedStep, fork_target
from loraflow.spec.compute import LocalCompute

if TYPE_CHECKING:
    from loraflow.launchers.environments import Environment
    from loraflow.launchers.identity import JobIdentity
    from loraflow.spec.compute import AnyCompute

__all__ = ["REFUSED_EXIT", "KillSwitch", "LineSink", "LocalLauncher", "StepRefused", "step_environment"]

#: The line a step's log starts with when it was forked from the launching process (``forked_step``).
FORKED_NOTE = "started as a fork of this process, whose environment it runs in"

#: A step program's exit status when it refused its input (a LoraflowError: bad data, bad config).
REFUSED_EXIT = 2


class StepRefused(StepError):
    """The step program refused its input and exited with ``REFUSED_EXIT``: running it again cannot help."""


class Killable(Protocol):
    def kill(self) -> None: ...


class KillSwitch:
    """What an operator's ``on_kill`` pulls: stops whichever launcher the runner started for the task
    (a local process group, or a remote job that is then cancelled)."""

    def __init__(self) -> None:
        self._targets: list[Killable] = []
        self._lock = threading.Lock()

    def arm(self, target: Killable) -> None:
        with self._lock:
            self._targets.append(target)

    def kill(self) -> None:
        with self._lock:
            targets = list(self._targets)
        for target in targets:
            target.kill()


# Variables a step program may need from the launching process; nothing else leaks through.
_PASSTHROUGH = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_PROJECT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "LORAFLOW_SCRATCH",
    "LORAFLOW_ENVS_DIR",
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    # JAX's persistent compilation cache, where the worker's deployer sets one (the test suite: a folder
    # of its session, every compilation kept; loraflow.trainer.argv.compile_cache_args)
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "LORAFLOW_FAULT",
    "LORAFLOW_FAULT_STATE",
    "LORAFLOW_LOG_LEVEL",
)


def step_environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    env = {k: os.environ[k] for k in _PASSTHROUGH if k in os.environ}
    env.setdefault("JAX_PLATFORMS", os.environ.get("LORAFLOW_JAX_PLATFORMS", "cpu"))
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("LORAFLOW_LOG_LEVEL", "WARNING").upper())
    env["PYTHONPATH"] = str(REPO_ROOT)
    env |= dict(extra)
    env |= STEP_ENV  # last: offline, no usage statistics (base.STEP_ENV)
    return env


#: Runs beside every local step and kills its process group when the launching process dies.
_SUPERVISOR = Path(__file__).with_name("step_supervisor.py")


class LocalLauncher(Launcher):
    """Runs one step program as a child process group and streams its output line by line.

    The step never outlives the process that launched it: if that process dies (SIGKILL included:
    a lost worker, the OOM killer), the step and everything it started are killed with SIGKILL
    (``loraflow/launchers/step_supervisor.py``), so a retry never runs beside a step of the try before."""

    config = LocalCompute
    where = "locally"

    def __init__(
        self, compute: AnyCompute | None = None, identity: JobIdentity | None = None, output_prefix: str = ""
    ) -> None:
        from loraflow.launchers.identity import JobIdentity

        super().__init__(compute or LocalCompute(), identity or JobIdentity("", "", "", ""), output_prefix)
        self._proc: subprocess.Popen[str] | ForkedStep | None = None
        self._lock = threading.Lock()

    def python(self, env: Environment, *, installed: bool = True) -> str:
        return str(env.local_python() if installed else env.venv_python())

    def check_secrets(self, secrets: Mapping[str, str]) -> None:
        return None  # they reach the step through its environment only, redacted in its output

    def summary(self, env: Environment) -> str:
        return f"in the {env.name} environment"

    def run(
        self,
        argv: Sequence[str],
        sink: LineSink,
        extra_env: Mapping[str, str] = {},
        secrets: Mapping[str, str] = {},
        on_workload: WorkloadSink = ignore_workload,
    ) -> None:
        """Run to the end; raise ``StepError`` (``StepRefused`` for refused input) naming the last error line.

        ``secrets`` go into the step's environment only; their values are replaced by ``***`` in every
        line passed to ``sink`` and in the error message."""
        redact = Redactor(secrets)
        env = step_environment({**extra_env, **secrets})
        # The tether: only this process holds the write end; when it dies, however it dies, the
        # supervisor (or the forked step itself) reads end of file and kills the step's process group
        # (loraflow/launchers/step_supervisor.py).
        tether, held = os.pipe()
        try:
            with self._lock:
                self._proc = None
                module = fork_target(argv)
                if module is not None:  # this process's own environment: no new interpreter
                    try:
                        self._proc = ForkedStep.start(module, argv, env, str(REPO_ROOT), tether, held)
                    except OSError as exc:  # e.g. no memory to copy this process's page tables into
                        sink(f"could not fork this process ({exc}); starting the step as a new interpreter")
                    else:
                        sink(f"{FORKED_NOTE} (pid {self._proc.pid})")
                if self._proc is None:
                    self._proc = subprocess.Popen(
                        [sys.executable or "python3", "-I", "-S", str(_SUPERVISOR), str(tether), "--", *argv],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        bufsize=1,
                        env=env,
                        cwd=str(REPO_ROOT),
                        start_new_session=True,  # its own process group: kill() reaches every child
                        pass_fds=(tether,),
                    )
        except BaseException:
            os.close(held)
            raise
        finally:
            os.close(tether)
        try:
            proc = self._proc
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                line = redact(line.rstrip("\n"))
                sink(line)
                tail = ([*tail, line])[-20:]
            rc = proc.wait()
        finally:
            os.close(held)  # the step has ended, or this launcher gave up on it: then it ends too
        if rc != 0:
            reason = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            last = next((t for t in reversed(tail) if "ERROR" in t or "Error" in t), tail[-1] if tail else "")
            error = StepRefused if rc == REFUSED_EXIT else StepError
            raise error(f"step {argv[2] if len(argv) > 2 else argv[0]} failed ({reason}): {last.strip()}")

    def kill(self) -> None:
        """Terminate the step program and everything it started (Airflow's on_kill)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
