"""Worker loss: a step program never outlives its task, and of two writers of one stage prefix exactly
one commits (decided by GCS's create-only precondition, never by reading back)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.storage import artifacts, gcs

REPO = Path(__file__).resolve().parents[2]

# The step program: starts a child, records both pids (the file appears whole), then both sleep.
STEP = """
import json, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
out = sys.argv[1]
with open(out + ".partial", "w") as fh:
    json.dump({"step": os.getpid(), "child": child.pid}, fh)
os.replace(out + ".partial", out)
time.sleep(600)
"""

# The Airflow task: launches the step through the LocalLauncher, from its main thread or from another.
TASK = """
import sys, threading
from loraflow.launchers.local import LocalLauncher

def launch():
    LocalLauncher().run([sys.executable, "-c", sys.argv[2], sys.argv[3]], print)

if sys.argv[1] == "thread":
    threading.Thread(target=launch).start()  # the main thread returns; the process lives on with the thread
else:
    launch()
"""


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in {"Z", "X"}


def wait_for(condition, what: str, seconds: float = 120) -> None:  # type: ignore[no-untyped-def]
    """A generous guard against a hang, not a measurement."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_a_sigkilled_task_takes_its_step_program_and_its_children_along(tmp_path: Path, launched_from: str) -> None:
    """The task process itself is SIGKILLed (a lost worker, the OOM killer): not on_kill, nothing runs in it
    afterwards. The step program and the child it started are gone, so no retry ever runs beside them."""
    pids_file = tmp_path / "pids.json"
    task = subprocess.Popen(
        [sys.executable, "-c", TASK, launched_from, STEP, str(pids_file)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(pids_file.exists, "the step program never started its child")
        pids = json.loads(pids_file.read_text())
        assert not gone(pids["step"]) and not gone(pids["child"])
        os.kill(task.pid, signal.SIGKILL)
        assert task.wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: gone(pids["step"]) and gone(pids["child"]), f"still running after the task died: {pids}")
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()


def test_a_step_ends_when_its_launcher_gives_up_on_it(tmp_path: Path) -> None:
    """The launcher's caller stops reading (its sink raised): the step does not run on unobserved."""
    from loraflow.launchers.local import LocalLauncher

    pids_file = tmp_path / "pids.json"
    code = STEP.replace("time.sleep(600)\n", "print('started', flush=True); time.sleep(600)\n", 1)
    code = code.rsplit("time.sleep(600)", 1)[0] + "print('pids written', flush=True)\ntime.sleep(600)\n"

    def sink(line: str) -> None:
        if line == "pids written":
            raise KeyboardInterrupt("the caller gives up")

    with pytest.raises(KeyboardInterrupt):
        LocalLauncher().run([sys.executable, "-c", code, str(pids_file)], sink)
    pids = json.loads(pids_file.read_text())
    wait_for(lambda: gone(pids["step"]) and gone(pids["child"]), f"still running after the launcher gave up: {pids}")


def commit_as(prefix: str, writer: str) -> artifacts.Manifest:
    return artifacts.commit(
        prefix,
        {"model.bin": {"size": 1, "crc32c": "AAAAAA=="}},
        stage="merge_adapter",
        inputs={},
        config={},
        lock_version="t",
        cache_key="k",
        summary={"writer": writer},
    )


def test_two_writers_of_one_stage_prefix_exactly_one_commits(strict_gcs_bucket: str) -> None:
    """Both writers have uploaded and both commit at once: GCS lets one manifest in and refuses the other."""
    prefix = gcs.join(strict_gcs_bucket, "tiny", "run-1", "merge_adapter")
    writers = ["old-step", "retry"]
    ready = threading.Barrier(len(writers))

    def commit(writer: str) -> str:
        ready.wait(timeout=300)  # a guard against a hang, not a measurement
        try:
            commit_as(prefix, writer)
            return "committed"
        except ArtifactError as exc:
            return str(exc)

    with ThreadPoolExecutor(len(writers)) as pool:
        outcomes = dict(zip(writers, pool.map(commit, writers), strict=True))
    winners = [w for w, outcome in outcomes.items() if outcome == "committed"]
    assert len(winners) == 1, outcomes
    (loser,) = set(writers) - set(winners)
    assert "committed by another writer first" in outcomes[loser] and "never overwritten" in outcomes[loser]
    assert artifacts.MANIFEST in outcomes[loser] and "merge_adapter" in outcomes[loser]
    assert artifacts.read_manifest(prefix).summary["writer"] == winners[0]


def test_a_commit_never_replaces_a_committed_manifest(strict_gcs_bucket: str) -> None:
    prefix = gcs.join(strict_gcs_bucket, "tiny", "run-1", "gate")
    commit_as(prefix, "first")
    with pytest.raises(ArtifactError, match="committed by another writer first"):
        commit_as(prefix, "second")
    assert artifacts.read_manifest(prefix).summary["writer"] == "first"


def test_an_emulator_whose_bucket_cannot_be_made_is_not_left_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's own commands start the emulator; a start that fails stops what it started."""
    from loraflow.dev import local_gcs

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(local_gcs.subprocess, "Popen", popen)
    with pytest.raises(LoraflowError, match="refused to create bucket 'Not_A_Bucket'"):
        local_gcs.start("Not_A_Bucket")
    assert started and all(p.poll() is not None for p in started)
