"""The demo's main process (`make ui`) killed as a supervisor or `timeout` would (issue 41, item 11).

One story on a home of its own: a first `demo ui` comes up, a run is triggered, and its main process is
killed with SIGKILL: its stack is orphaned, as it was by a plain SIGTERM before the fix. A second
`demo ui` on the same home ends those orphans before it starts, marks the dead stack's run failed, comes
up, and a SIGTERM to its main process then stops every process it started, as Ctrl-C does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loraflow.dev import stack_guard
from loraflow.dev.demo import LocalAirflow, say
from loraflow.spec.schema import load_spec
from tests.processes import descendants, identities, still_running

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DAG = load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml").name
# As /proc names them (the API server and the executor's workers rename themselves).
COMPONENTS = ("api_server", "local_scheduler", "dag-processor", "triggerer", "fake-gcs-server")
TAKEN = {"running", "success", "failed", "up_for_retry"}  # the states of a task a worker has taken


class Demo:
    """``python -m loraflow.dev.demo ui`` on ``home``, its output in a file."""

    def __init__(self, home: Path, name: str) -> None:
        self.home = home
        self.out = home.parent / f"{name}.out"
        env = {**os.environ, "LORAFLOW_DEMO_HOME": str(home), "PYTHONPATH": str(REPO)}
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "loraflow.dev.demo", "ui"], env=env, cwd=REPO, stdout=out, stderr=out
            )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, line: str, seconds: float = 600) -> re.Match[str]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if found := re.search(line, self.text()):
                return found
            assert self.proc.poll() is None, f"the demo exited ({self.proc.returncode}):\n{self.text()}"
            time.sleep(1)
        raise AssertionError(f"no {line!r} within {seconds:.0f} s:\n{self.text()}")

    def airflow(self) -> LocalAirflow:
        """Its Airflow, once the API server answers."""
        port = int(self.wait_for(r"starting Airflow on http://127\.0\.0\.1:(\d+)")[1])
        airflow = LocalAirflow(self.home / "airflow", {}, port=port)
        deadline = time.monotonic() + 600
        while True:
            try:
                airflow.token()
                return airflow
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.text()
                time.sleep(2)


@dataclass
class Story:
    orphans: dict[int, str] = field(default_factory=dict)  # what the SIGKILLed demo left
    orphan_ids: set[tuple[int, int]] = field(default_factory=set)  # the same as (pid, start time)
    dead_run: str = ""
    second: Demo | None = None
    tree: set[tuple[int, int]] = field(default_factory=set)  # every process below the second demo as it ran
    stack: dict[int, str] = field(default_factory=dict)  # and every process of its stack
    stack_ids: set[tuple[int, int]] = field(default_factory=set)
    exit_code: int | None = None
    stop_seconds: float = 0.0


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    home = tmp_path_factory.mktemp("demo-stop") / ".demo"
    s = Story()
    began = time.monotonic()
    demos: list[Demo] = []
    try:
        demos.append(first := Demo(home, "first"))
        airflow = first.airflow()
        say(f"first demo up in {time.monotonic() - began:.0f} s")
        first.wait_for(r"Airflow UI: ")  # its sources prepared (no tiny model left half-made), its DAG parsed
        s.dead_run = airflow.trigger(DAG)
        deadline = time.monotonic() + 300
        while not TAKEN & set(airflow.task_states(DAG, s.dead_run).values()):  # a LocalExecutor worker took it
            assert time.monotonic() < deadline, "the first demo's run never started a task"
            time.sleep(1)
        first.proc.kill()  # no stop at all
        first.proc.wait()
        s.orphans = stack_guard.stack_processes(home)
        s.orphan_ids = identities(s.orphans)
        say(f"first demo killed with its run's first task taken at {time.monotonic() - began:.0f} s")

        demos.append(second := Demo(home, "second"))
        s.second = second
        second.wait_for(r"marked failed")  # Airflow is up: the demo prepares its sources next
        say(f"second demo up at {time.monotonic() - began:.0f} s")
        s.tree = identities(descendants(second.proc.pid))
        s.stack = stack_guard.stack_processes(home)
        s.stack_ids = identities(s.stack)
        started = time.monotonic()
        second.proc.send_signal(signal.SIGTERM)
        s.exit_code = second.proc.wait(timeout=120)
        s.stop_seconds = time.monotonic() - started
        yield s
    finally:  # whatever a failed test left: the demos this test started, their stack (this home's only)
        for demo in demos:
            if demo.proc.poll() is None:
                demo.proc.kill()
                demo.proc.wait()
        stack_guard.end_stack_processes(home, grace=2)


def test_a_killed_demo_orphans_its_whole_stack(story: Story) -> None:
    """What the second demo found (before the fix, a SIGTERM left the same)."""
    commands = " ".join(story.orphans.values())
    for component in (*COMPONENTS, "LocalExecutor"):  # and the workers running the run's first task
        assert component in commands, story.orphans


def test_the_next_start_ends_what_the_dead_stack_left_and_fails_its_run(story: Story) -> None:
    assert story.second is not None
    out = story.second.text()
    assert re.search(r"an earlier stack on .* did not stop \(pid \d+\); ended what it left: ", out), out
    assert story.orphan_ids and not still_running(story.orphan_ids)
    assert f"run {story.dead_run} of {DAG}, left running by an earlier stack: marked failed" in out


def test_sigterm_stops_every_process_of_the_stack_as_ctrl_c_does(story: Story) -> None:
    assert story.second is not None
    commands = " ".join(story.stack.values())
    for component in COMPONENTS:
        assert component in commands, story.stack
    assert story.stack_ids and not still_running(story.tree | story.stack_ids), story.second.text()
    # The signal lands as the demo prepares its sources (exit 128 + SIGTERM) or, on a machine where that went
    # faster than the test's look at /proc, once the UI is up (`ui` ends 0 on a stop): each says so.
    text = story.second.text()
    if "SIGTERM: stopping everything" in text:
        assert story.exit_code == 0 and "Airflow UI: " in text, text
    else:
        assert story.exit_code == 128 + signal.SIGTERM and "stopped by SIGTERM" in text, text
    assert story.stop_seconds < 60
    assert (story.second.home / "stack.pid").read_text() == ""
