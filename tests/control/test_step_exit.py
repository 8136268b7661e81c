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


def test_every_step_program_ends_with_exit_process() -> None:
    for path in sorted((REPO / "loraflow" / "steps").glob("[!_]*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' in text:
            main = text.split('if __name__ == "__main__":', 1)[1]
            ends = "exit_process(run_step(" in main or ("= run_step(" in main and "exit_process(status" in main)
            assert ends, f"{path.name}: end __main__ with exit_process(run_step(...))"
