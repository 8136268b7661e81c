"""A step program ends as a normal exit would (status, threads, atexit handlers, flushed output),
without the interpreter's teardown that the task would otherwise wait for after the commit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A process that ends the way every step program's __main__ does. Each marker is something a normal
# exit does (or, for "teardown", what exit_process skips): the parent reads them from the pipe.
CHILD = """
import atexit, os, sys, threading, time
from loraflow.steps._harness import exit_process

class Teardown:  # destroyed only when the interpreter tears its modules down
    def __del__(self, write=os.write):
        write(1, b"teardown\\n")

KEEP = Teardown()

def worker():
    time.sleep(0.2)
    print("thread finished")

threading.Thread(target=worker).start()  # not a daemon: a normal exit waits for it
atexit.register(lambda: print("atexit ran"))
print("buffered, never flushed by hand")  # stdout is a pipe: block-buffered
exit_process(int(sys.argv[1]), wait=len(sys.argv) < 3)
print("unreachable")
"""


@pytest.mark.parametrize("status", [0, 2])
def test_exit_process_keeps_a_normal_exit_but_skips_the_teardown(status: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(status)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == status, proc.stderr
    # what a normal exit does: the thread is waited for, then the atexit handlers run, output is flushed
    assert lines == ["buffered, never flushed by hand", "thread finished", "atexit ran"], (lines, proc.stderr)
    # what it skips: no object is destroyed one by one at the end (the seconds a task waited for)
    assert "teardown" not in lines


def test_a_failed_host_of_a_job_exits_at_once_with_its_output_flushed() -> None:
    """``wait=False`` (lora_sft on a host of a multi-host job that failed): the thread, which could be waiting
    for the other hosts, is not waited for and no atexit handler runs (JAX's shutdown barrier); the status
    and what was printed still come out."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, "2", "at once"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.splitlines() == ["buffered, never flushed by hand"], proc.stderr


# A step program's __main__ (run_and_exit) whose step raises: argv[1] is what it raises ("loraflow",
# "other" or "nothing"), argv[2] whether it is a host of a multi-host job ("job": leave_at_once true; else none given).
FAILING = """
import atexit, sys, threading, time
from loraflow.errors import LoraflowError
from loraflow.steps import _harness

def worker():
    time.sleep(1)
    print("thread finished")

def call(stage, fn, args):  # run_step's call of the step, without GCS (no inputs, nothing committed)
    return fn(None)

def run(ctx):
    threading.Thread(target=worker).start()  # not a daemon: a normal exit waits for it
    atexit.register(lambda: print("atexit ran"))
    print("training", flush=True)
    if raised == "loraflow":
        raise LoraflowError("the data pipeline failed")
    if raised == "other":
        raise RuntimeError("an error nobody named")
    return 0  # the status run_step returns for a step that ended well

raised, where = sys.argv[1:]
sys.argv[1:] = ["--output", "gs://bucket/lora_sft"]
_harness._run = call
_harness.run_and_exit("lora_sft", run, leave_at_once=(lambda: True) if where == "job" else None)
"""


def _failing(raised: str, where: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FAILING, raised, where],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


@pytest.mark.parametrize("raised", ["loraflow", "other"])
def test_a_host_of_a_job_that_fails_with_any_exception_leaves_at_once(raised: str) -> None:
    """On a host of a multi-host job (lora_sft's ``leave_at_once``) an exception loraflow did not name
    leaves at once too, its traceback printed: its threads and the shutdown barrier are not waited for."""
    proc = _failing(raised, "job")
    assert proc.stdout.splitlines() == ["training"], (proc.stdout, proc.stderr)
    if raised == "other":
        assert proc.returncode == 1
        assert "RuntimeError: an error nobody named" in proc.stderr and "Traceback" in proc.stderr
    else:
        assert (proc.returncode, proc.stderr) == (2, "[lora_sft] ERROR: the data pipeline failed\n")


def test_an_exception_on_a_single_host_ends_as_pythons_own_exit_does() -> None:
    """Not in a job: the exception escapes (Python prints it, exit status 1) and the process still waits
    for its threads and runs its atexit handlers, as it always did."""
    proc = _failing("other", "alone")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "RuntimeError: an error nobody named", proc.stderr
    assert proc.stdout.splitlines() == ["training", "thread finished", "atexit ran"], proc.stderr


def test_every_step_program_ends_with_run_and_exit() -> None:
    for path in sorted((REPO / "loraflow" / "steps").glob("[!_]*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' in text:
            main = text.split('if __name__ == "__main__":', 1)[1]
            assert "run_and_exit(" in main, f"{path.name}: end __main__ with run_and_exit(STAGE, run)"


def test_a_host_of_a_job_that_ends_well_waits_as_a_normal_exit_does() -> None:
    """A host of a job whose step ended well still waits for its threads and runs its atexit handlers: JAX's
    shutdown barrier is how it waits for process 0 to commit the outputs."""
    proc = _failing("nothing", "job")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["training", "thread finished", "atexit ran"], proc.stderr
