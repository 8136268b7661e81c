"""A step of the launching process's own environment is forked from that process instead of started as
a new interpreter (loraflow/launchers/forked_step.py). What the step sees, what the task sees of it,
and how it ends are the same either way; these tests run one probe step both ways and compare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraflow.launchers.local import FORKED_NOTE
from loraflow.storage import artifacts, gcs

REPO = Path(__file__).resolve().parents[2]

# The step: reports what it sees, then ends as its first argument says.
PROBE = r"""
import json, logging, os, sys, time
logging.getLogger("probe").warning("a warning from the step")
print(json.dumps({
    "pid": os.getpid(), "pgid": os.getpgid(0), "argv": sys.argv[1:], "cwd": os.getcwd(),
    "env": sorted(os.environ), "secret_arrived": os.environ.get("TOKEN") == "s3cret",
    "stdin": sys.stdin.read(), "secret_line": os.environ.get("TOKEN"),
}), flush=True)
mode = sys.argv[1]
if mode == "refuse":
    print("ERROR: the dataset is empty", file=sys.stderr)
    sys.exit(2)
if mode == "raise":
    raise RuntimeError("boom in the step")
if mode == "signal":
    os.kill(os.getpid(), 9)
if mode == "sleep":
    print("sleeping", flush=True)
    time.sleep(600)
from loraflow.steps._harness import exit_process
exit_process(0)  # as every step program ends: atexit handlers run
"""

# The Airflow task: its own logging, atexit handler and variables; launches the probe from its main thread.
# argv: DIR HOW MODE, where HOW is "fork" (the default), "thread" (another thread is alive), "off"
# (LORAFLOW_FORK_STEPS=0), "fork fails" (os.fork raises ENOMEM). On SIGTERM it pulls the launcher's kill (Airflow's on_kill).
TASK = r"""
import atexit, json, logging, os, signal, sys, threading, time
where, how, mode = sys.argv[1:4]
sys.path.insert(0, where)
# Its own stream objects over fds 0-2, as Airflow's task runner has.
sys.stdin, sys.stdout, sys.stderr = open(0), open(1, "w", buffering=1), open(2, "w", buffering=1)
from loraflow.launchers.local import LocalLauncher
logging.basicConfig(filename=os.path.join(where, "task.log"))
atexit.register(lambda: open(os.path.join(where, "task-atexit"), "a").write(f"{os.getpid()}\n"))
os.environ["TASK_ONLY"] = "not for steps"
if how == "thread":
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
if how == "off":
    os.environ["LORAFLOW_FORK_STEPS"] = "0"
if how == "fork fails":
    def no_fork():
        raise OSError(12, "Cannot allocate memory")
    os.fork = no_fork
launcher = LocalLauncher()
signal.signal(signal.SIGTERM, lambda *_: launcher.kill())
lines = []
def sink(line):
    lines.append(line)
    if line == "sleeping":
        open(os.path.join(where, "sleeping"), "w").close()
try:
    launcher.run([sys.executable, "-m", "probe_step", mode], sink, {"PYTHONPATH": where}, {"TOKEN": "s3cret"})
    outcome = "ok"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print(json.dumps({"lines": lines, "outcome": outcome, "task": os.getpid(), "task_group": os.getpgid(0)}), flush=True)
"""


def start_task(tmp_path: Path, how: str, mode: str) -> subprocess.Popen[str]:
    (tmp_path / "probe_step.py").write_text(PROBE)
    return subprocess.Popen(
        [sys.executable, "-c", TASK, str(tmp_path), how, mode],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def run_task(tmp_path: Path, how: str, mode: str) -> dict:
    task = start_task(tmp_path, how, mode)
    out, _ = task.communicate("the task's input, not the step's\n", timeout=120)
    assert task.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    probe = next(json.loads(line) for line in result["lines"] if line.startswith("{"))
    return {**result, "probe": probe}


@pytest.mark.parametrize("how", ["fork", "thread", "off", "fork fails"])
def test_the_step_sees_a_fresh_program_whether_forked_or_not(tmp_path: Path, how: str) -> None:
    result = run_task(tmp_path, how, "ok")
    probe = result["probe"]
    assert result["outcome"] == "ok"
    # Forked only from a one-thread process with forking on; the task log says so, and says why not
    # when the fork itself failed (the step is then a new interpreter).
    assert (result["lines"][0].startswith(FORKED_NOTE)) == (how == "fork"), result["lines"][:2]
    failed_fork = (
        "could not fork this process ([Errno 12] Cannot allocate memory); starting the step as a new interpreter"
    )
    assert (result["lines"][0] == failed_fork) == (how == "fork fails"), result["lines"][:2]
    assert probe["pid"] != result["task"] and probe["pgid"] != result["task_group"]  # a group on_kill can stop
    assert probe["argv"] == ["ok"] and probe["cwd"] == str(REPO) and probe["stdin"] == ""
    assert "TASK_ONLY" not in probe["env"] and "LORAFLOW_FORK_STEPS" not in probe["env"]
    assert {"TOKEN", "PYTHONPATH", "PYTHONUNBUFFERED"} <= set(probe["env"]) and probe["secret_arrived"]
    assert probe["secret_line"] == "***" and not any("s3cret" in line for line in result["lines"])
    # The step's log goes to its own output, not to the task's handlers; the task's atexit runs once.
    assert "a warning from the step" in result["lines"]
    assert "a warning from the step" not in (tmp_path / "task.log").read_text()
    assert (tmp_path / "task-atexit").read_text().split() == [str(result["task"])]


@pytest.mark.parametrize("how", ["fork", "off"])
@pytest.mark.parametrize(
    ("mode", "outcome"),
    [
        ("refuse", "StepRefused: step probe_step failed (exit status 2): ERROR: the dataset is empty"),
        ("raise", "StepError: step probe_step failed (exit status 1): RuntimeError: boom in the step"),
        ("signal", "StepError: step probe_step failed (killed by signal 9): "),
    ],
)
def test_a_step_ends_the_same_way_forked_or_not(tmp_path: Path, how: str, mode: str, outcome: str) -> None:
    result = run_task(tmp_path, how, mode)
    assert result["outcome"].startswith(outcome), result["outcome"]


def test_on_kill_stops_a_forked_step(tmp_path: Path) -> None:
    task = start_task(tmp_path, "fork", "sleep")
    deadline = time.monotonic() + 60
    while not (tmp_path / "sleeping").exists():
        assert time.monotonic() < deadline and task.poll() is None, "the step never started"
        time.sleep(0.05)
    task.send_signal(signal.SIGTERM)
    out, _ = task.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["lines"][0].startswith(FORKED_NOTE)
    assert result["outcome"].startswith("StepError: step probe_step failed (killed by signal 15)")


def test_a_forked_process_makes_its_own_gcs_client(gcs_bucket: str) -> None:
    """A fork must not share the parent's pooled HTTP connections."""
    code = (
        "import os; from loraflow.storage import gcs\n"
        "parent = gcs.client(); pid = os.fork()\n"
        "if pid == 0: os._exit(0 if gcs.client() is not parent and gcs.client() is gcs.client() else 1)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}).returncode == 0


def test_reading_gcs_starts_no_background_thread(gcs_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GCS library's bucket-metadata cache would start a thread on a bucket's first use and after
    every 404: alive when a task launches its step, it would keep the step from being forked."""
    gcs.client.cache_clear()
    started: list[str] = []
    real_start = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    assert artifacts.read_json(f"{gcs_bucket}/missing/_MANIFEST.json") is None
    artifacts.read_json(f"{gcs_bucket}/missing/_MANIFEST.json")
    assert started == []
