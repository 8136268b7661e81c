"""The tiny pipeline on a distributed Airflow, as production runs it: the CeleryExecutor with a Redis
broker, PostgreSQL as the metadata database, and two Celery workers that share no disk (own HOME, TMPDIR,
scratch, Airflow home and spec cache; only the DAG folder, the database, the broker and GCS in common;
task logs in GCS). While lora_sft's step program runs on one worker, that worker is lost: every process
of it is SIGKILLed. The run still completes: the scheduler notices the task's missing heartbeat, fails
that try, and the spec's retry runs it on the other worker. The stack is the distributed one the
end-to-end modules share (tests/e2e/conftest.py), the spec with a DAG name and an artifact root of its
own; the lost worker is replaced as the module ends. Takes ~5 minutes on 2 cores."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from loraflow.dev.demo import CELERY_PRELOAD, LocalAirflow, prepare, say, verdict
from loraflow.dev.local_celery import CeleryWorkers
from loraflow.dev.shared_stack import SharedStack
from loraflow.launchers.local import FORKED_NOTE
from loraflow.spec.schema import STAGES
from loraflow.storage import artifacts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
NAME = "tiny-celery"
ARTIFACT_ROOT = "gs://loraflow-demo/celery-artifacts"  # its own in the shared stack: no stage from another's cache
WORKERS = CeleryWorkers()  # the distributed stack's: two workers of two slots, a 45 s heartbeat timeout
# Few steps: the run proves the distribution, not the learning (tests/e2e/test_tiny_pipeline.py does).
CONF = {"training_steps": 10, "gate_min_improvement": -1}
STEP_MARKS = ("loraflow.steps.", "step_supervisor.py")


def celery_spec(folder: Path) -> Path:
    text = TINY.read_text().replace("name: tiny-llama-lora", f"name: {NAME}")
    text = text.replace("artifact_root: gs://loraflow-demo/artifacts", f"artifact_root: {ARTIFACT_ROOT}")
    text += "\nretry:\n  retries: 2\n  delay_seconds: 2\n"
    path = folder / f"{NAME}.yaml"
    path.write_text(text)
    return path


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _is_step(proc: psutil.Process) -> bool:
    return any(mark in _cmdline(proc) for mark in STEP_MARKS)


def pool_has_preloaded(worker_pid: int, timeout: float = 180) -> bool:
    """Whether the worker's pool processes, before running any task, have pandas's compiled modules mapped
    (Celery's ``imports``: ``CELERY_PRELOAD``); waits for the pool to exist."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Celery names its pool processes; the worker has other children (Airflow's own helpers).
        pool = [p for p in _tree(worker_pid)[1:] if "ForkPoolWorker" in _cmdline(p)]
        if len(pool) == WORKERS.concurrency:
            break
        time.sleep(1)
    else:
        return False
    for proc in pool:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        if "/pandas/_libs/" not in maps:
            return False
    return True


def lose_worker_running(airflow: LocalAirflow, task: str, timeout: float = 900) -> tuple[str, list[int]]:
    """Once ``task``'s step program runs, SIGKILL every process of the worker it runs on, but the step
    programs: a lost machine. Returns (worker, the step processes' ids), which must then die on their own
    (loraflow/launchers/step_supervisor.py: a step never outlives its task process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in airflow.workers.items():
            tree = _tree(proc.pid)
            steps = [p for p in tree if _is_step(p) and f"loraflow.steps.{task}" in _cmdline(p)]
            if steps:
                time.sleep(3)  # well into the step: it has imported JAX and reads its inputs
                tree = _tree(proc.pid)
                step_pids = [p.pid for p in tree if _is_step(p)]
                for p in tree:
                    if not _is_step(p):
                        os.kill(p.pid, signal.SIGKILL)
                say(f"lost {name}: SIGKILLed {len(tree) - len(step_pids)} processes while {task} ran on it")
                return name, step_pids
        time.sleep(1)
    raise AssertionError(f"{task} never started a step program on a worker within {timeout:.0f} s")


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


class Outcome:
    def __init__(self, airflow: LocalAirflow) -> None:
        self.airflow = airflow
        self.run_id = ""
        self.state = ""
        self.preloaded: dict[str, bool] = {}
        self.lost = ""
        self.orphans: list[int] = []
        self.tasks: dict[str, str | None] = {}
        self.tries: dict[str, list[dict[str, Any]]] = {}
        self.verdict: dict[str, Any] = {}
        self.logs_missing: list[str] = []
        self.seconds = 0.0


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory, distributed_stack: SharedStack) -> Iterator[Outcome]:
    started = time.monotonic()
    home = tmp_path_factory.mktemp("celery")
    spec_path = celery_spec(home)
    af = distributed_stack.use(__name__, spec_path)
    assert af.celery == WORKERS, af.celery
    o = Outcome(af)
    try:
        o.preloaded = {name: pool_has_preloaded(proc.pid) for name, proc in af.workers.items()}
        spec = prepare(spec_path, home)
        af.wait_for_dag(NAME)
        o.run_id = af.trigger(NAME, CONF)
        o.lost, steps = lose_worker_running(af, "lora_sft")
        deadline = time.monotonic() + 60
        while alive(steps) and time.monotonic() < deadline:
            time.sleep(1)
        o.orphans = alive(steps)
        o.state = af.wait_for_run(NAME, o.run_id, timeout=1800)
        o.tasks = af.task_states(NAME, o.run_id)
        o.tries = {task: af.task_tries(NAME, o.run_id, task) for task in o.tasks}
        o.verdict = verdict(spec, af, o.run_id)
        o.logs_missing = af.wait_for_logs(NAME, o.run_id, [t for t, s in o.tasks.items() if s != "skipped"])
        o.seconds = time.monotonic() - started
        say(
            f"celery run: {o.seconds:.0f} s; lora_sft tries: {[(t['hostname'], t['state']) for t in o.tries['lora_sft']]}"
        )
        yield o
    finally:
        if o.lost:  # the stack's next module finds both workers up
            af.replace_worker(o.lost)


def test_the_run_completes_although_a_worker_was_lost_mid_stage(outcome: Outcome) -> None:
    assert outcome.state == "success", outcome.tasks
    assert set(outcome.tasks) == set(STAGES)
    assert all(s in ("success", "skipped") for s in outcome.tasks.values()), outcome.tasks
    assert outcome.verdict["tuned"].get("accuracy") is not None
    assert outcome.verdict["published"], "publish ran on a worker and registered the model"


def test_the_lost_try_is_retried_on_the_surviving_worker(outcome: Outcome) -> None:
    tries = outcome.tries["lora_sft"]
    assert len(tries) >= 2, tries
    assert tries[0]["hostname"] == outcome.lost and tries[0]["state"] != "success", tries
    assert tries[-1]["state"] == "success" and tries[-1]["hostname"] != outcome.lost, tries
    # lora_sft's committed output is whole and verifies, though its first writer died mid-stage.
    manifest = artifacts.read_manifest(outcome.airflow.xcom(NAME, outcome.run_id, "lora_sft")["manifest"])
    assert manifest.data["config"]["steps"] == CONF["training_steps"]


def test_every_task_ran_on_a_celery_worker_and_none_on_the_lost_one_after_it_was_lost(outcome: Outcome) -> None:
    names = set(WORKERS.names())
    for task, tries in outcome.tries.items():
        assert tries and all(t["hostname"] in names for t in tries), (task, tries)
    for task in ("merge_adapter", "evaluate_tuned", "gate", "publish", "report"):
        assert [t["hostname"] for t in outcome.tries[task]] == [n for n in names if n != outcome.lost], task


def test_the_lost_workers_step_program_died_with_it(outcome: Outcome) -> None:
    assert outcome.orphans == [], f"step processes outlived their lost worker: {outcome.orphans}"


def test_control_steps_are_forked_from_their_task_on_a_celery_worker(outcome: Outcome) -> None:
    """The light steps start as forks of their task (loraflow/launchers/forked_step.py) on a Celery
    worker too; their logs come from GCS (remote logging), since no worker can read another's disk."""
    assert outcome.logs_missing == [], "every task's log reaches GCS once its try ends"
    for task in ("validate_data", "gate", "publish", "report"):
        assert FORKED_NOTE in outcome.airflow.task_log(NAME, outcome.run_id, task, try_number=None), task


def test_each_worker_preloaded_what_its_tasks_import(outcome: Outcome) -> None:
    assert "pandas" in CELERY_PRELOAD
    assert outcome.preloaded == dict.fromkeys(WORKERS.names(), True)
