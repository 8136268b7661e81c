"""The local stack's guard (loraflow/dev/stack_guard.py): SIGTERM and SIGHUP stop the stack as Ctrl-C
does, a start after an abnormal stop ends what the dead stack left (only what provably was its), and a
wait on a run ends when a task is never started. Real processes (sleep, a Python owner of a home), no
Airflow: tests/e2e/test_demo_stop.py does the same with the demo's real stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev import demo, stack_guard
from loraflow.dev.stack_guard import (
    Proc,
    StopSignal,
    belonging,
    carries_marker,
    leftover_runs,
    marker_env,
    owned,
    parse_record,
    stuck_queued_task,
    uninterrupted,
)
from loraflow.errors import LoraflowError
from tests.processes import alive, descendants, identities, still_running

REPO = Path(__file__).resolve().parents[2]

# A stand-in for the demo's main process: owns the home, starts two processes of the stack, each an
# `sh` leading a session of its own with a `sleep` in it: one with the stack's marker in its environment
# (its `sleep` without), one without the marker but recorded, as the stack records a component that
# renames itself (its marker then gone from /proc). Says "up", sleeps.
# ``IGNORE_TERM=1``: they ignore SIGTERM, so that the stop lasts until SIGKILL (1 s grace).
OWNER = """
import os, subprocess, sys, time
from pathlib import Path
from loraflow.dev.stack_guard import marker_env, owned, record
home = Path(sys.argv[1])
trap = 'trap "" TERM; ' if os.environ.get("IGNORE_TERM") else ""
with owned(home, grace=1.0):
    subprocess.Popen(["sh", "-c", trap + "env -u LORAFLOW_DEMO_STACK sleep 300 & wait"],
                     env={**os.environ, **marker_env(home)}, start_new_session=True)
    renamed = subprocess.Popen(["sh", "-c", trap + "sleep 300 & wait"], start_new_session=True)
    record(marker_env(home), renamed.pid)
    print("up", flush=True)
    time.sleep(120)
"""


def wait_until(condition, seconds: float = 20) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


class Owner:
    """The stand-in main process, and the processes of its stack (found while it runs)."""

    def __init__(self, home: Path, ignore_term: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)} | ({"IGNORE_TERM": "1"} if ignore_term else {})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(home)], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "up"
        assert wait_until(lambda: len(descendants(self.proc.pid)) >= 4)
        self.stack = identities(descendants(self.proc.pid))  # each sh and its sleep

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def output(self) -> str:
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.fixture
def owners() -> Iterator[list[Owner]]:
    started: list[Owner] = []
    yield started
    for owner in started:  # only what these tests started, by pid
        for pid, _ in still_running(owner.stack):
            os.kill(pid, signal.SIGKILL)
        if owner.proc.poll() is None:
            owner.proc.kill()
        owner.proc.wait()


@pytest.fixture
def sleeper() -> Iterator[Any]:
    """Start `sleep 300` with an environment of one's choosing; each is killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen(["sleep", "300"], env={**os.environ, **env}, start_new_session=True))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------- decisions


def test_the_marker_names_exactly_one_home(tmp_path: Path) -> None:
    home = tmp_path / ".demo"
    ours = f"PATH=/bin\0LORAFLOW_DEMO_STACK={home.resolve()}\0HOME=/root\0".encode()
    assert carries_marker(ours, home)
    assert not carries_marker(ours, tmp_path / ".demo2")  # another clone's (or home's) stack
    assert not carries_marker(f"LORAFLOW_DEMO_STACK={home.resolve()}/x\0".encode(), home)
    assert not carries_marker(f"OTHER=LORAFLOW_DEMO_STACK={home.resolve()}\0".encode(), home)
    assert not carries_marker(b"", home)
    assert marker_env(home) == {"LORAFLOW_DEMO_STACK": str(home.resolve())}


def test_what_belongs_to_the_stack() -> None:
    def proc(pid: int, ppid: int, sid: int, started: int = 100, marked: bool = False) -> Proc:
        return Proc(pid, ppid, sid, started, marked)

    procs = {
        p.pid: p
        for p in [
            proc(1, 0, 1),
            proc(50, 1, 50),  # a shell
            proc(60, 50, 50),  # the demo's main process: kept, with its ancestors
            proc(70, 60, 70, marked=True),  # a component that kept its environment
            proc(71, 70, 71),  # its task process, in a session of its own: a descendant
            proc(80, 60, 80, started=500),  # a component that renamed itself: recorded
            proc(81, 1, 80),  # an orphan left in the recorded component's session
            proc(90, 1, 90, started=900),  # the pid of a recorded process, reused: another process
            proc(91, 1, 90),  # in that other process's session
            proc(95, 1, 95),  # unrelated
            proc(96, 1, 96, marked=True),  # an orphan that kept the marker
            proc(97, 96, 96),  # its child
            proc(98, 1, 97),  # in a session whose leader is not recorded: nothing proves it
        ]
    }
    recorded = {(80, 500), (90, 300)}
    assert belonging(procs, recorded, keep=60) == {70, 71, 80, 81, 96, 97}
    procs[60] = proc(60, 50, 50, marked=True)  # a main process started with the marker: still kept
    procs[50] = proc(50, 1, 50, marked=True)
    assert belonging(procs, recorded, keep=60) == {70, 71, 80, 81, 96, 97}


def test_the_record_names_the_main_process_then_what_it_started() -> None:
    assert parse_record("") == (None, set())
    assert parse_record("123\n456 7890\n457 7891\n") == (123, {(456, 7890), (457, 7891)})
    assert parse_record("x\n456 7890\n456\nnot a line\n1 2 3\n") == (None, {(456, 7890)})
    assert parse_record("456 7890\n") == (None, {(456, 7890)})  # no main process line


def test_a_signal_in_an_uninterrupted_block_stops_at_its_end(tmp_path: Path) -> None:
    reached = False
    with owned(tmp_path / ".demo"):
        with pytest.raises(StopSignal) as stop, uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run by now
            reached = True
    assert reached and stop.value.signum == signal.SIGTERM


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def test_leftover_runs_are_the_unfinished_runs_queued_before_this_stack_started() -> None:
    start = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
    before, after = iso(start - timedelta(minutes=5)), iso(start + timedelta(seconds=1))
    runs = [
        {"dag_run_id": "old-running", "state": "running", "queued_at": before},
        {"dag_run_id": "old-queued", "state": "queued", "queued_at": before},
        {"dag_run_id": "old-done", "state": "success", "queued_at": before},
        {"dag_run_id": "old-failed", "state": "failed", "queued_at": before},
        {"dag_run_id": "new", "state": "running", "queued_at": after},  # the new scheduler made it
        {"dag_run_id": "started-only", "state": "running", "queued_at": None, "start_date": before},
        {"dag_run_id": "no-time", "state": "running", "queued_at": "yesterday"},
        {"dag_run_id": "at-start", "state": "running", "queued_at": iso(start)},
    ]
    assert [r["dag_run_id"] for r in leftover_runs(runs, start)] == ["old-running", "old-queued", "started-only"]


def test_a_task_is_stuck_once_queued_with_no_progress_for_the_bound() -> None:
    states = {"validate_data": "success", "convert_checkpoint": "queued", "lora_sft": None}
    assert stuck_queued_task(states, quiet_for=299.9, bound=300) is None
    assert stuck_queued_task(states, quiet_for=300, bound=300) == "convert_checkpoint"
    assert stuck_queued_task({**states, "convert_checkpoint": "running"}, quiet_for=9999, bound=300) is None
    assert stuck_queued_task({"a": "scheduled"}, quiet_for=9999, bound=300) is None  # waits for a slot: legal
    assert stack_guard.QUEUED_BOUND == 300


# ---------------------------------------------------------------------------------- wait_for_run


class FakeRun(demo.LocalAirflow):
    """A LocalAirflow whose REST answers come from ``timeline`` (seconds -> task states), on a fake clock."""

    def __init__(self, home: Path, timeline: dict[float, dict[str, str | None]]) -> None:
        super().__init__(home, {})
        self.timeline = timeline
        self.now = 0.0
        self.patched: list[tuple[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.runs_status = 200

    def states(self) -> dict[str, str | None]:
        return self.timeline[max(t for t in self.timeline if t <= self.now)]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if method == "PATCH":
            self.patched.append((path, body))
            return 200, {}
        if path.startswith("/dags/~/dagRuns"):
            return (200, {"dag_runs": self.runs}) if self.runs_status == 200 else (self.runs_status, {})
        if path.endswith("/taskInstances"):
            return 200, {"task_instances": [{"task_id": t, "state": s} for t, s in self.states().items()]}
        if "/taskInstances/" in path:
            task = path.rsplit("/", 1)[1]
            return 200, {"task_id": task, "state": self.states()[task], "try_number": 1}
        done = all(s == "success" for s in self.states().values())
        return 200, {"state": "success" if done else "running"}


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeRun]]:
    runs: list[FakeRun] = []

    def sleep(seconds: float) -> None:
        for run in runs:
            run.now += seconds

    monkeypatch.setattr(demo.time, "monotonic", lambda: runs[0].now)
    monkeypatch.setattr(demo.time, "sleep", sleep)
    yield runs


def test_a_task_never_started_ends_the_wait_with_its_state_and_log_path(
    tmp_path: Path, fake_clock: list[FakeRun]
) -> None:
    run = FakeRun(tmp_path / "airflow", {0: {"validate_data": "queued", "report": None}})
    fake_clock.append(run)
    with pytest.raises(LoraflowError) as refused:
        run.wait_for_run("tiny-qwen3-lora", "manual__1", progress=lambda _: None)
    message = str(refused.value)
    assert "task validate_data of tiny-qwen3-lora run manual__1 is queued and has not started in 300 s" in message
    log = tmp_path / "airflow" / "logs" / "dag_id=tiny-qwen3-lora/run_id=manual__1/task_id=validate_data/attempt=1.log"
    assert str(log) in message and "scheduler.log" in message and "`make clean`" in message
    assert 300 <= run.now < 310  # the bound, not the run's timeout


def test_a_queued_task_beside_a_moving_run_is_waited_for(tmp_path: Path, fake_clock: list[FakeRun]) -> None:
    timeline: dict[float, dict[str, str | None]] = {
        0: {"lora_sft": "running", "evaluate_base": "queued"},  # both queued a while, the run moving
        200: {"lora_sft": "success", "evaluate_base": "queued"},
        400: {"lora_sft": "success", "evaluate_base": "running"},
        450: {"lora_sft": "success", "evaluate_base": "success"},
    }
    run = FakeRun(tmp_path / "airflow", timeline)
    fake_clock.append(run)
    assert run.wait_for_run("d", "r", progress=lambda _: None, queued_bound=300) == "success"


def test_the_runs_an_earlier_stack_left_are_marked_failed_and_said(tmp_path: Path) -> None:
    run = FakeRun(tmp_path / "airflow", {0: {}})
    start = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
    run.runs = [
        {
            "dag_id": "tiny-qwen3-lora",
            "dag_run_id": "manual__old",
            "state": "running",
            "queued_at": "2026-12-06T03:00:00Z",
        },
        {"dag_id": "tiny-qwen3-lora", "dag_run_id": "scheduled__new", "state": "queued", "queued_at": iso(start)},
    ]
    lines = run.fail_leftover_runs(start)
    assert run.patched == [("/dags/tiny-qwen3-lora/dagRuns/manual__old", {"state": "failed"})]
    assert lines == ["run manual__old of tiny-qwen3-lora, left running by an earlier stack: marked failed"]
    run.runs_status = 422
    assert run.fail_leftover_runs(start) == ["could not list the runs an earlier stack may have left (HTTP 422: {})"]


# ---------------------------------------------------------------------------------- real processes


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_ends_the_owner_and_every_process_of_its_stack(
    tmp_path: Path, owners: list[Owner], sig: signal.Signals
) -> None:
    owners.append(owner := Owner(tmp_path / ".demo"))
    owner.stop(sig)
    out = owner.output()
    assert owner.proc.returncode != 0  # the signal ended it, through the stop
    assert not still_running(owner.stack), out  # the unmarked sleep too: its group was ended
    assert (tmp_path / ".demo" / "stack.pid").read_text() == ""  # stopped cleanly


def test_a_second_signal_does_not_cut_the_stop_short(tmp_path: Path, owners: list[Owner]) -> None:
    owners.append(owner := Owner(tmp_path / ".demo", ignore_term=True))  # the stop lasts 1 s: SIGTERM ignored
    owner.stop(signal.SIGTERM)
    time.sleep(0.4)
    owner.stop(signal.SIGTERM)
    owner.stop(signal.SIGINT)
    out = owner.output()
    assert "SIGTERM ignored: the local stack is stopping" in out
    assert "SIGINT ignored" in out
    assert not still_running(owner.stack)


def test_a_running_stack_is_refused_naming_its_pid(tmp_path: Path, owners: list[Owner]) -> None:
    owners.append(owner := Owner(tmp_path / ".demo"))
    with pytest.raises(
        LoraflowError, match=rf"running on .* already \(pid {owner.proc.pid}\).*`kill {owner.proc.pid}`"
    ):
        with owned(tmp_path / ".demo"):
            pass
    assert still_running(owner.stack) == owner.stack  # a running stack's processes are not touched


def test_a_start_after_an_abnormal_stop_ends_only_what_the_dead_stack_left(
    tmp_path: Path, owners: list[Owner], sleeper: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / ".demo"
    owners.append(owner := Owner(home))
    other_home = sleeper(marker_env(tmp_path / "other-clone" / ".demo"))
    unmarked = sleeper({})
    owner.stop(signal.SIGKILL)  # no stop at all: its stack is orphaned
    owner.proc.wait()
    assert still_running(owner.stack) == owner.stack
    with owned(home, grace=1.0):
        said = capsys.readouterr().out
        assert not still_running(owner.stack)
    assert f"an earlier stack on {home} did not stop (pid {owner.proc.pid}); ended what it left: " in said
    assert "sh -c" in said
    assert alive(other_home.pid) and alive(unmarked.pid)  # not this home's: never touched
    assert (home / "stack.pid").read_text() == ""


def test_a_process_that_loses_its_proof_as_its_leader_ends_is_ended_all_the_same(tmp_path: Path) -> None:
    """A recorded session leader, and in its session an unmarked child that ignores SIGTERM: once the
    leader has ended, nothing in /proc ties the child to the stack (the orphaned LocalExecutor worker
    of a killed stack did so), yet it was the stack's when first seen and is killed after the grace."""
    home = tmp_path / ".demo"
    home.mkdir()
    leader = subprocess.Popen(["sh", "-c", "sh -c 'trap \"\" TERM; exec sleep 300' & wait"], start_new_session=True)
    try:
        stack_guard.record(marker_env(home), leader.pid)
        assert wait_until(lambda: len(descendants(leader.pid)) == 1)
        child = identities(descendants(leader.pid))
        ended = stack_guard.end_stack_processes(home, grace=0.5)
        assert not still_running(child)
        assert sorted(ended) == sorted([leader.pid, *(pid for pid, _ in child)])
    finally:
        leader.kill()
        leader.wait()


# A component that starts a process of its own group in its session, as the scheduler's worker does
# with a task process; no marker anywhere.
COMPONENT = "import subprocess, time; subprocess.Popen(['sleep', '300'], process_group=0); time.sleep(300)"


def test_what_ran_as_the_stop_began_is_ended_though_stopping_its_component_left_it_unprovable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / ".demo"
    component = subprocess.Popen([sys.executable, "-c", COMPONENT], start_new_session=True)
    try:
        with owned(home, grace=0.5) as stop_begins:
            stack_guard.record(marker_env(home), component.pid)
            assert wait_until(lambda: len(descendants(component.pid)) == 1)
            task = identities(descendants(component.pid))
            stop_begins()
            os.killpg(component.pid, signal.SIGKILL)  # the component's group: its task is in another
            component.wait()
            assert still_running(task) == task
        assert not still_running(task)
        assert f"ended what was left of the stack: {next(iter(task))[0]} sleep 300" in capsys.readouterr().out
    finally:
        for pid, _ in still_running(task):
            os.kill(pid, signal.SIGKILL)


def test_a_clean_stop_leaves_nothing_to_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with owned(tmp_path / ".demo"):
        assert (tmp_path / ".demo" / "stack.pid").read_text() == f"{os.getpid()}\n"
    with owned(tmp_path / ".demo"):
        pass
    assert capsys.readouterr().out == ""


def test_the_owner_nested_in_one_process_is_the_outer_one(tmp_path: Path, sleeper: Any) -> None:
    home = tmp_path / ".demo"
    with owned(home, grace=1.0):
        marked = sleeper(marker_env(home))  # e.g. the Celery demo's PostgreSQL, started before the stack
        with owned(home):
            pass
        assert alive(marked.pid)  # the inner owner neither refused nor ended it
    assert not alive(marked.pid)  # the outer one did, last
