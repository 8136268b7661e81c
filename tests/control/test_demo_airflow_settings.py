"""The local stack's scheduler starts tasks warm: its LocalExecutor workers come from a forkserver
that preloads what every loraflow task imports, and Airflow reads those settings as they are written.
A module name that does not import would be skipped by the forkserver without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraflow.dev import demo
from loraflow.dev.demo import WORKER_PRELOAD, LocalAirflow

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh control-env interpreter with the stack's environment: what Airflow makes of the
# settings, and whether each preloaded module imports (and brings no loraflow code along with it).
PROBE = """
import importlib, json, sys
from airflow.configuration import conf
from airflow.utils.process_utils import resolve_mp_start_method

failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({
    "start_method": resolve_mp_start_method("scheduler"),
    "preload": conf.get("scheduler", "mp_forkserver_preload"),
    "idle_sleep": conf.getfloat("scheduler", "scheduler_idle_sleep_time"),
    "heartbeat": conf.getint("workers", "min_heartbeat_interval"),
    "failed": failed,
    "ours": sorted(m for m in sys.modules if m.split(".")[0] in ("loraflow", "operators", "dags")),
}))
"""


def test_the_scheduler_preloads_importable_third_party_modules_into_its_workers(tmp_path: Path) -> None:
    airflow = LocalAirflow(tmp_path / "home", {})
    env = {**airflow.env, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *WORKER_PRELOAD],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["start_method"] == "forkserver"
    assert seen["preload"].split(",") == list(WORKER_PRELOAD)
    assert seen["failed"] == {}, "the forkserver would skip these without a word"
    # loraflow's own code is imported by each task afresh: a changed loraflow needs no scheduler restart
    assert seen["ours"] == []
    assert seen["idle_sleep"] < 1.0  # Airflow's default is 1 s between two idle scheduler loops
    assert seen["heartbeat"] < 5  # Airflow's default: a task's end may go unnoticed for 5 s


# Runs in a fresh interpreter with the stack's environment: what the local stack's scheduler does first.
PRESTART = """
import json, psutil
from operators.local_scheduler import prestart_forkserver

thread = prestart_forkserver()
if thread is not None:
    thread.join(120)
print(json.dumps([p.cmdline() for p in psutil.Process().children()]))
"""


def _prestart(env: dict[str, str], cwd: Path) -> list[list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PRESTART], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    children: list[list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return children


def test_the_scheduler_starts_its_preloading_forkserver_before_any_task_is_queued(tmp_path: Path) -> None:
    """Without it the first run's first task waited 4-5 s for the forkserver's imports."""
    airflow = LocalAirflow(tmp_path / "home", {})
    children = _prestart({**airflow.env, "PYTHONPATH": str(REPO)}, tmp_path)
    servers = [" ".join(c) for c in children if "multiprocessing.forkserver" in " ".join(c)]
    assert len(servers) == 1, children
    assert all(repr(module) in servers[0] for module in WORKER_PRELOAD), servers[0]


def test_with_another_start_method_the_scheduler_starts_no_forkserver(tmp_path: Path) -> None:
    airflow = LocalAirflow(tmp_path / "home", {})
    env = {**airflow.env, "PYTHONPATH": str(REPO), "AIRFLOW__SCHEDULER__MP_START_METHOD": "fork"}
    children = _prestart(env, tmp_path)
    assert not [c for c in children if "multiprocessing.forkserver" in " ".join(c)], children


def test_local_stack_env_reaches_every_airflow_process_and_not_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``local_stack(env=...)``: the environment every component, worker and step program of the stack is
    started with has it (a fault to inject, a connection); the process that started the stack never has it."""
    emulator = SimpleNamespace(host="http://127.0.0.1:9", env=lambda: {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"})
    emulator.stop = lambda: None
    monkeypatch.setattr(demo.local_gcs, "start", lambda *args, **kwargs: emulator)
    monkeypatch.setattr(demo.LocalAirflow, "start", lambda self: None)
    monkeypatch.setattr(demo.LocalAirflow, "fail_leftover_runs", lambda self, started_at: [])
    monkeypatch.delenv("LORAFLOW_FAULT", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    planted = {"LORAFLOW_FAULT": "lora_sft:mid_training", "STORAGE_EMULATOR_HOST": "http://elsewhere"}
    with demo.local_stack(home=tmp_path / "home", in_memory=True, env=planted) as airflow:
        assert airflow.env["LORAFLOW_FAULT"] == "lora_sft:mid_training"
        assert airflow.env["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:9"  # the stack's own emulator wins
        assert "LORAFLOW_FAULT" not in os.environ
    assert "LORAFLOW_FAULT" not in os.environ
