"""The local stack's CeleryExecutor option: Airflow and its Celery provider read the settings as written,
every module the workers preload imports (Celery's ``imports`` stops a worker at start on one that does
not), and a stack that could not work is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev import local_celery
from loraflow.dev.demo import CELERY_PRELOAD, WORKER_PRELOAD, LocalAirflow
from loraflow.dev.local_celery import CeleryWorkers
from loraflow.errors import LoraflowError

REPO = Path(__file__).resolve().parents[2]
PG = "postgresql+psycopg2://airflow@127.0.0.1:5999/airflow"

# Runs in a fresh control-env interpreter with the stack's environment (nothing is contacted).
PROBE = """
import importlib, json, sys
from airflow.configuration import conf
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG as c

failed = {}
for name in c["imports"]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({
    "executor": conf.get("core", "executor"),
    "broker": c["broker_url"],
    "result_backend": c["result_backend"],
    "acks_late": c["task_acks_late"],
    "concurrency": c["worker_concurrency"],
    "prefetch": c["worker_prefetch_multiplier"],
    "imports": c["imports"],
    "heartbeat_timeout": conf.getint("scheduler", "task_instance_heartbeat_timeout"),
    "remote_logs": [conf.getboolean("logging", "remote_logging"), conf.get("logging", "remote_base_log_folder")],
    "start_method": conf.get("scheduler", "mp_start_method", fallback=None),
    "log_io": type(__import__("airflow.logging_config").logging_config.get_remote_task_log()).__name__,
    "failed": failed,
}))
"""


def test_airflow_reads_the_celery_settings_as_written(tmp_path: Path) -> None:
    workers = CeleryWorkers(count=2, concurrency=3, heartbeat_timeout=40)
    airflow = LocalAirflow(tmp_path / "home", {}, database_url=PG, celery=workers)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**airflow.env, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["executor"] == "CeleryExecutor"
    assert seen["broker"] == f"redis://127.0.0.1:{airflow.broker_port}/0"
    assert seen["result_backend"] == f"db+{PG}"  # the metadata database every worker reaches
    assert seen["acks_late"] is True and seen["prefetch"] == 1
    assert seen["concurrency"] == 3
    assert seen["imports"] == list(CELERY_PRELOAD)
    assert seen["failed"] == {}, "a Celery worker stops at start on these"
    assert seen["heartbeat_timeout"] == 40  # Airflow's default, 300 s, would hold a lost worker's task 5 minutes
    assert seen["remote_logs"] == [True, "gs://loraflow-demo/_airflow-logs"]
    assert seen["log_io"] == "EmulatorGCSRemoteLogIO"  # what writes and reads them (operators/emulator_task_logs.py)
    assert seen["start_method"] is None  # the LocalExecutor's forkserver is not started for nothing


def test_the_celery_preload_is_the_local_one_without_the_local_executor() -> None:
    assert set(CELERY_PRELOAD) == set(WORKER_PRELOAD) - {"airflow.executors.local_executor"}
    assert "pandas" in CELERY_PRELOAD


def test_celery_on_sqlite_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(LoraflowError, match=r"database_url.*PostgreSQL"):
        LocalAirflow(tmp_path / "home", {}, celery=CeleryWorkers())
    with pytest.raises(LoraflowError, match="not SQLite"):
        LocalAirflow(tmp_path / "home", {}, database_url=f"sqlite:///{tmp_path}/a.db", celery=CeleryWorkers())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "at least one worker"),
        ({"concurrency": 0}, "at least one worker"),
        ({"heartbeat_timeout": 3}, "10 s"),
    ],
)
def test_impossible_worker_settings_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(LoraflowError, match=message):
        CeleryWorkers(**kwargs)


def test_a_worker_names_itself_as_the_stack_named_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_celery.HOSTNAME_ENV, "celery-worker-2")
    assert local_celery.worker_hostname() == "celery-worker-2"
    monkeypatch.delenv(local_celery.HOSTNAME_ENV)
    assert local_celery.worker_hostname()  # the machine's own name
    assert CeleryWorkers(count=3).names() == ["celery-worker-1", "celery-worker-2", "celery-worker-3"]


def test_task_logs_are_written_to_and_read_from_the_gcs_emulator(
    gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Airflow's own handler refuses to write a new log to the emulator (its 404 lacks GCS's "No such
    object"); the stack's handler writes it, appends a later write, and reads both back."""
    from airflow.providers.google.cloud.log.gcs_task_handler import GCSRemoteLogIO

    from operators.emulator_task_logs import EmulatorGCSRemoteLogIO

    stack = LocalAirflow(tmp_path / "home", {}, database_url=PG, celery=CeleryWorkers()).env
    for name in ("AIRFLOW__LOGGING__REMOTE_LOG_CONN_ID", "AIRFLOW_CONN_LORAFLOW_TASK_LOGS"):
        monkeypatch.setenv(name, stack[name])  # the stack's connection for its task logs
    remote = f"{gcs_bucket}/airflow-logs"
    where = f"{remote}/dag_id=d/run_id=r/task_id=t/attempt=1.log"
    kwargs: dict[str, Any] = {"base_log_folder": tmp_path, "remote_base": remote, "delete_local_copy": False}
    assert GCSRemoteLogIO(**kwargs).write("first", where) is False
    io = EmulatorGCSRemoteLogIO(**kwargs)
    assert io.write("first", where) is True
    assert io.write("second", where) is True
    _, streams = io.read("dag_id=d/run_id=r/task_id=t/attempt=1.log", None)
    assert streams == ["first\nsecond"]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_only_a_lost_worker_is_replaced_and_on_an_empty_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``replace_worker``: a worker still running is refused; one whose process is gone starts again under
    its own name, with its old disk (HOME, scratch, Airflow home) gone, as a new machine would."""
    airflow = LocalAirflow(tmp_path / "home", {}, database_url=PG, celery=CeleryWorkers())
    started: list[str] = []

    def start_worker(name: str) -> subprocess.Popen[bytes]:
        started.append(name)
        return _sleeper()

    monkeypatch.setattr(airflow, "_start_worker", start_worker)
    old = airflow.workers["celery-worker-1"] = _sleeper()
    left = airflow.home / "workers" / "celery-worker-1" / "home" / "left-by-the-lost-machine"
    left.parent.mkdir(parents=True)
    left.write_text("x")
    try:
        with pytest.raises(LoraflowError, match="celery-worker-1 is still running: only a lost worker is replaced"):
            airflow.replace_worker("celery-worker-1")
        assert started == [] and left.exists()
        old.kill()
        old.wait()
        airflow.replace_worker("celery-worker-1")
        assert started == ["celery-worker-1"] and not left.exists()
        assert airflow.workers["celery-worker-1"] is not old and airflow.workers["celery-worker-1"].poll() is None
    finally:
        for proc in airflow.workers.values():
            proc.kill()
            proc.wait()
