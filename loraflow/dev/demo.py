"""Run loraflow locally the way it runs in production: Airflow + GCS, all on 127.0.0.1.

    python -m loraflow.dev.demo run     # `make demo`: start everything, run the tiny pipeline, print the verdict, stop
    python -m loraflow.dev.demo ui      # `make ui`: start everything and keep it up for the web UI

The GCS emulator keeps its data under .demo/gcs, Airflow its database and logs under .demo/airflow.
Airflow runs as its real components (API server, scheduler with the LocalExecutor, DAG processor, triggerer)
with a password generated at first start. Nothing here is imported by the DAGs or the steps.

``local_stack(..., celery=CeleryWorkers())`` runs it distributed instead, as production does: the
CeleryExecutor with a Redis broker and Celery workers that share no disk (``loraflow.dev.local_celery``),
on a PostgreSQL metadata database (``loraflow.dev.local_postgres``); tests/e2e/test_celery_workers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraflow.dev import local_gcs, local_postgres, stack_guard
from loraflow.dev.db_template import DATABASE, DB_TEMPLATE_ENV, db_template, sqlite_url
from loraflow.dev.local_celery import HOSTNAME_ENV, Broker, CeleryWorkers, start_broker
from loraflow.dev.process_groups import end_groups
from loraflow.dev.separate_hosts import host_dirs
from loraflow.dev.stack_guard import say
from loraflow.errors import LoraflowError
from loraflow.evaluation.metrics import METRICS
from loraflow.launchers.environments import ENVIRONMENTS, REPO_ROOT
from loraflow.reporting.curves import tensorboard_command
from loraflow.reporting.urls import browser_url
from loraflow.spec.cache import CACHE_ENV
from loraflow.spec.locate import PIPELINES_ENV
from loraflow.spec.schema import PipelineSpec, load_spec
from loraflow.spec.stages import REPORT_HTML
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary

DEMO_HOME = Path(os.environ.get("LORAFLOW_DEMO_HOME", REPO_ROOT / ".demo"))
TINY_SPEC = REPO_ROOT / "pipelines" / "tiny-llama-lora.yaml"
TINY_DATA = REPO_ROOT / "pipelines" / "data" / "parity"
TERMINAL = {"success", "failed"}

# The LocalExecutor's workers come from a forkserver that imported these once: Airflow's task
# supervisor and DAG bag, google-cloud-storage (the cache lookup, the manifests), the Google
# provider's gs:// Asset handler (each task's lineage) and pydantic (the spec). A task then starts
# without importing them: about 1 s less per task on 2 cores (docs/benchmarks.md, section 6;
# docs/production.md, "Airflow settings"). pandas and its Parquet reader are for the control
# environment's steps, which are forked from their task (loraflow/launchers/forked_step.py): the
# gate reads the evaluations' predictions with them (0.26 s to import on 2 cores). The scheduler
# starts that forkserver as it starts (operators/local_scheduler.py), not when the first task is
# queued. loraflow's own modules are not preloaded, so a changed loraflow reaches the next task
# without a scheduler restart.
WORKER_PRELOAD = (
    "airflow.executors.local_executor",
    "airflow.sdk.execution_time.supervisor",
    "airflow.dag_processing.dagbag",
    "google.cloud.storage",
    "airflow.providers.google.assets.gcs",
    "pydantic",
    "pandas",
    "pyarrow.parquet",
)
# A Celery worker has no forkserver: each of its pool processes runs its tasks one after another, each
# task process forked from it (Airflow's supervisor), so what the worker imported before it started its
# pool reaches every task. Celery's ``imports`` setting imports these in the worker's main process first
# (the LocalExecutor itself is not used there).
CELERY_PRELOAD = tuple(m for m in WORKER_PRELOAD if m != "airflow.executors.local_executor")


# ---------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class TinyModel:
    """A tiny model the demo makes: the task whose text trains its tokenizer, how it splits numbers, its family."""

    data: Path  # train.jsonl and eval.jsonl of the task (what `make demo` uploads beside the model)
    numbers: str  # loraflow.dev.tinymodel's --numbers
    family: str = "llama"  # loraflow.dev.tinymodel's --family


# The tiny models by the name the specs give them (the last part of base_model.hf_checkpoint).
TINY_MODELS = {
    "tiny-llama": TinyModel(TINY_DATA, "digits"),
    "tiny-llama-arithmetic": TinyModel(REPO_ROOT / "pipelines" / "data" / "arithmetic", "groups"),
    "tiny-qwen3": TinyModel(TINY_DATA, "digits", "qwen3"),
    "tiny-gemma3": TinyModel(TINY_DATA, "digits", "gemma3"),
}


def tiny_model_for(spec: PipelineSpec) -> tuple[str, TinyModel]:
    """The tiny model a spec's base_model.hf_checkpoint names: (name, how it is made)."""
    name = spec.base_model.hf_checkpoint.rstrip("/").rsplit("/", 1)[-1]
    if name not in TINY_MODELS:
        raise LoraflowError(
            f"the demo makes the tiny models {', '.join(TINY_MODELS)}, but {spec.name}'s base_model.hf_checkpoint "
            f"ends in {name!r}: point it at gs://loraflow-demo/sources/<one of them>"
        )
    return name, TINY_MODELS[name]


def make_tiny_model(dest: Path, tiny: TinyModel = TINY_MODELS["tiny-llama"]) -> Path:
    """The tiny HF checkpoint, made once by the trainer environment's Python (numpy, tokenizers)."""
    if (dest / "model.safetensors").exists():
        return dest
    python = ENVIRONMENTS["trainer"].local_python()
    argv = ["-m", "loraflow.dev.tinymodel", "--out", str(dest), "--corpus", str(tiny.data / "train.jsonl")]
    subprocess.run(
        [str(python), *argv, "--numbers", tiny.numbers, "--family", tiny.family],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    return dest


def _upload_file(local: Path, uri: str) -> None:
    bucket, path = gcs.split_uri(uri)
    gcs.client().bucket(bucket).blob(path).upload_from_filename(str(local), checksum="crc32c")


def seed_sources(spec_path: Path, model_dir: Path, data_dir: Path = TINY_DATA) -> Iterator[str]:
    """Upload the tiny model and the task's datasets to where the spec expects them."""
    spec = load_spec(spec_path)
    client = gcs.client()
    for uri in (spec.artifact_root, spec.base_model.hf_checkpoint, spec.data.train):
        bucket = gcs.split_uri(uri)[0]
        if client.lookup_bucket(bucket) is None:
            client.create_bucket(bucket)
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        _upload_file(path, gcs.join(spec.base_model.hf_checkpoint, path.name))
    yield f"model {model_dir} -> {spec.base_model.hf_checkpoint}"
    for name, uri in (("train.jsonl", spec.data.train), ("eval.jsonl", spec.data.eval)):
        _upload_file(data_dir / name, uri)
        yield f"dataset {data_dir / name} -> {uri}"


# ---------------------------------------------------------------------------------- Airflow


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only: the file is created 0600 (never world-
    readable, not even for a moment) beside ``path`` and renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a crashed earlier process of the same id
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LocalAirflow:
    """Airflow's API server, scheduler (LocalExecutor, or CeleryExecutor with ``celery``), DAG processor
    and triggerer on 127.0.0.1; with ``celery``, a Redis broker and the Celery workers too."""

    # The triggerer runs deferred tasks' triggers (a Vertex AI stage waiting for its job).
    COMPONENTS = (
        ["api-server"],
        ["scheduler", "--skip-serve-logs"],
        ["dag-processor"],
        ["triggerer", "--skip-serve-logs"],
    )

    def __init__(
        self,
        home: Path,
        env: dict[str, str],
        port: int | None = None,
        pipelines_dir: Path | None = None,
        database_url: str | None = None,
        parallelism: int = 4,
        celery: CeleryWorkers | None = None,
    ):
        """``database_url``: the metadata DB as an SQLAlchemy URL (e.g. PostgreSQL); default SQLite in ``home``.
        ``parallelism``: how many tasks the executor runs at once. ``celery``: run the CeleryExecutor and
        these workers instead of the LocalExecutor (needs ``database_url``: every worker reaches it)."""
        self.home = home
        self.port = port or local_gcs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.password = self._password()
        self._token: str | None = None
        bin_dir = Path(sys.executable).parent
        self.airflow = str(bin_dir / "airflow")
        self.env = {
            **os.environ,
            **env,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url or sqlite_url(home),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secret("jwt_secret"),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__SCHEDULER__MP_START_METHOD": "forkserver",
            "AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD": ",".join(WORKER_PRELOAD),
            # An idle scheduler loop sleeps this long (Airflow's default: 1 s) before it looks for
            # tasks whose upstream just finished: the wait between two tasks of a chain.
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.25",
            # A worker may notice that its task process ended only when its wait for the task's
            # output times out, and that wait is this heartbeat interval (Airflow's default: 5 s).
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(local_gcs.free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(local_gcs.free_port()),
        }
        if pipelines_dir is not None:
            self.env[PIPELINES_ENV] = str(pipelines_dir)
        self.celery = celery
        self.broker: Broker | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        if celery is not None:
            self.env |= self._celery_settings(celery, database_url)
            for forkserver_only in ("AIRFLOW__SCHEDULER__MP_START_METHOD", "AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD"):
                del self.env[forkserver_only]  # the LocalExecutor's; the scheduler then starts no forkserver

    def _celery_settings(self, celery: CeleryWorkers, database_url: str | None) -> dict[str, str]:
        """What the CeleryExecutor, its workers and the scheduler's lost-worker handling are set to."""
        if not database_url or database_url.startswith("sqlite"):
            raise LoraflowError(
                "the CeleryExecutor needs a metadata database every worker reaches: pass database_url "
                "(PostgreSQL, e.g. loraflow.dev.local_postgres.running()), not SQLite"
            )
        self.broker_port = local_gcs.free_port()
        logs_bucket = json.dumps({"conn_type": "google_cloud_platform", "extra": {"is_anonymous": True}})
        return {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{self.broker_port}/0",
            # The result backend is Airflow's default: the metadata database (db+postgresql://...).
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(celery.concurrency),
            # Airflow's default, stated: a message is acknowledged when its task ends, not when a worker
            # takes it. A worker lost mid-task leaves its message unacknowledged in Redis; Redis hands it
            # out again only after the broker's visibility timeout (Airflow's default: 86400 s), long after
            # the scheduler has retried the task (below); the late copy is then refused as already run.
            "AIRFLOW__CELERY__TASK_ACKS_LATE": "True",
            "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": json.dumps({"imports": list(CELERY_PRELOAD)}),
            # A task whose worker vanished stops heartbeating (every [workers] min_heartbeat_interval,
            # 1 s here): after this many seconds the scheduler fails that try, and the spec's retries
            # start the next on a worker that is alive. Airflow's default is 300 s.
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(celery.heartbeat_timeout),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            # No worker reads another's disk, nor does the API server: task logs go to GCS, as on Composer
            # (with a handler that takes the emulator's 404 for "no log yet": operators/emulator_task_logs.py).
            "AIRFLOW__LOGGING__REMOTE_LOGGING": "True",
            "AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS": "operators.emulator_task_logs.LOGGING_CONFIG",
            "AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER": "gs://loraflow-demo/_airflow-logs",
            "AIRFLOW__LOGGING__REMOTE_LOG_CONN_ID": "loraflow_task_logs",
            "AIRFLOW_CONN_LORAFLOW_TASK_LOGS": logs_bucket,
        }

    def _secret(self, name: str) -> str:
        path = self.home / name
        if not path.exists():
            write_private(path, secrets.token_urlsafe(24))
        return path.read_text().strip()

    def _password(self) -> str:
        password = self._secret("admin_password")
        write_private(self.home / "passwords.json", json.dumps({"admin": password}))
        return password

    def start(self, timeout: float = 420) -> None:  # generous: a loaded machine starts it slowly
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self._migrate()
        if self.celery is not None:
            self.broker = start_broker(self.home / "redis", self.broker_port, env=self.env)
            stack_guard.record(self.env, self.broker.process.pid)  # Redis renames itself: the marker is lost
            for name in self.celery.names():
                self.workers[name] = self._start_worker(name)
        for component in self.COMPONENTS:
            self.procs.append(self._start_component(component))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in [*self.procs, *self.workers.values()]:
                if proc.poll() is not None:
                    raise LoraflowError(f"an Airflow component exited at start; see {logs}")
            try:
                self.token()
                self._warm_execution_api()
                return
            except (OSError, LoraflowError):
                time.sleep(2)
        raise LoraflowError(f"Airflow did not come up on {self.url} within {timeout:.0f} s; see {logs}")

    def _migrate(self) -> None:
        """``airflow db migrate``, or, for a new SQLite database with ``$LORAFLOW_AIRFLOW_DB_TEMPLATE`` set,
        a copy of the database the first such stack migrated in that folder (``loraflow.dev.db_template``)."""
        template = os.environ.get(DB_TEMPLATE_ENV)
        on_sqlite = self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == sqlite_url(self.home)
        if template and on_sqlite and not (self.home / DATABASE).exists():
            db_template(Path(template), Path(self.airflow)).copy_to(self.home)
            return
        subprocess.run([self.airflow, "db", "migrate"], env=self.env, check=True, stdout=subprocess.DEVNULL)

    def _warm_execution_api(self) -> None:
        """The API server builds its execution API (what task processes call) on the first request to
        it: 2.9 s on 2 cores, which the first task of the first run waited for as it reported itself
        running. Asked once here, while nothing waits on it."""
        with urllib.request.urlopen(f"{self.url}/execution/health", timeout=120) as resp:
            resp.read()

    def _start_component(self, component: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.home / "logs" / f"{component[0]}.log", "ab")
        if component[0] == "scheduler":  # with its workers' forkserver started at once
            command = [sys.executable, "-m", "operators.local_scheduler", *component[1:]]
        else:
            command = [self.airflow, *component]
        # Its own session: stop() ends the component and what it started together (the scheduler's
        # forkserver and executor workers), and a Ctrl-C reaches the demo only, which then stops them.
        with stack_guard.uninterrupted():
            proc = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            stack_guard.record(self.env, proc.pid)
        return proc

    def _start_worker(self, name: str) -> subprocess.Popen[bytes]:
        """A Celery worker as a machine of its own: its own HOME, TMPDIR, scratch, Airflow home (local
        task logs, pid file) and spec cache; a host name of its own in the task instances."""
        assert self.celery is not None
        root = self.home / "workers"
        dirs, work = host_dirs(root, name)
        airflow_home = root / name / "airflow"
        airflow_home.mkdir(parents=True, exist_ok=True)
        env = {
            **self.env,
            **dirs,
            "AIRFLOW_HOME": str(airflow_home),
            CACHE_ENV: str(Path(dirs["XDG_CACHE_HOME"]) / "loraflow" / "specs"),
            HOSTNAME_ENV: name,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "loraflow.dev.local_celery.worker_hostname",
        }
        command = [self.airflow, "celery", "worker", "--concurrency", str(self.celery.concurrency)]
        command += ["--celery-hostname", f"{name}@%h", "--skip-serve-logs", "--without-mingle", "--without-gossip"]
        out = open(self.home / "logs" / f"{name}.log", "ab")
        # Its own session: stop() ends the worker and its pool together, as a machine going away would.
        with stack_guard.uninterrupted():
            proc = subprocess.Popen(
                command, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            stack_guard.record(env, proc.pid)
        return proc

    def restart(self, name: str) -> None:
        """Stop one component (e.g. ``triggerer``) as a deploy would, and start it again."""
        (i,) = [i for i, c in enumerate(self.COMPONENTS) if c[0] == name]
        proc = self.procs[i]
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.procs[i] = self._start_component(self.COMPONENTS[i])

    def replace_worker(self, name: str) -> None:
        """Start Celery worker ``name`` again, on an empty disk, once every process of it is gone: a lost
        machine replaced (as a managed instance group or an autoscaler would), so the stack has its
        workers back for what runs next."""
        if self.workers[name].poll() is None:
            raise LoraflowError(f"{name} is still running: only a lost worker is replaced")
        shutil.rmtree(self.home / "workers" / name, ignore_errors=True)
        self.workers[name] = self._start_worker(name)

    def exited(self) -> list[str]:
        """The components that are no longer running."""
        return [c[0] for c, p in zip(self.COMPONENTS, self.procs, strict=False) if p.poll() is not None]

    def stop(self) -> None:
        """End every component and worker with its process group (SIGTERM; SIGKILL after 30 s), then the broker."""
        end_groups([*self.procs, *self.workers.values()])
        self.procs.clear()
        self.workers.clear()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    # REST ------------------------------------------------------------------------------------

    def token(self) -> str:
        if self._token is None:
            body = json.dumps({"username": "admin", "password": self.password}).encode()
            req = urllib.request.Request(
                f"{self.url}/auth/token", body, {"Content-Type": "application/json"}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                self._token = json.load(resp)["access_token"]
        return self._token

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token()}", "Content-Type": "application/json"}
        req = urllib.request.Request(f"{self.url}/api/v2{path}", data, headers, method=method)
        # On a loaded machine the API server can answer late: a read (GET) is asked again, a few times.
        attempts = 4 if method == "GET" else 1
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(req, timeout=30 if attempts > 1 else 120) as resp:
                    return resp.status, json.load(resp)
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")
                try:
                    return exc.code, json.loads(text)
                except ValueError:
                    return exc.code, text
            except (TimeoutError, urllib.error.URLError):
                if attempt == attempts - 1:
                    raise
                time.sleep(5)
        raise AssertionError("unreachable")

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, _ = self.call("GET", f"/dags/{dag_id}")
            if status == 200:
                return
            time.sleep(2)
        raise LoraflowError(f"DAG {dag_id} did not appear within {timeout:.0f} s; check `loraflow validate`")

    def import_errors(self) -> list[dict[str, Any]]:
        _, body = self.call("GET", "/importErrors")
        errors: list[dict[str, Any]] = body.get("import_errors", []) if isinstance(body, dict) else []
        return errors

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        self.call("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        for attempt in range(3):
            status, body = self.call("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
            # SQLite answers a write that met a busy database with HTTP 500 "Database error"; the
            # transaction rolled back (no run was created), so asking again is safe.
            if not (status == 500 and "Database error" in json.dumps(body)) or attempt == 2:
                break
            time.sleep(2 * (attempt + 1))
        if status != 200:
            raise LoraflowError(f"Airflow refused the run (HTTP {status}): {body}")
        run_id: str = body["dag_run_id"]
        return run_id

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        _, body = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti["state"] for ti in body.get("task_instances", [])}

    def wait_for_run(
        self,
        dag_id: str,
        run_id: str,
        timeout: float = 1800,
        progress: Callable[[str], None] = say,
        queued_bound: float = stack_guard.QUEUED_BOUND,
    ) -> str:
        """Wait for the run's end; its final state. Raises after ``timeout`` seconds, or as soon as a task
        has been queued for ``queued_bound`` seconds while no task of the run changed state."""
        seen: dict[str, str | None] = {}
        deadline = time.monotonic() + timeout
        started = last_change = time.monotonic()
        while time.monotonic() < deadline:
            states = self.task_states(dag_id, run_id)
            now = time.monotonic()
            for task, state in states.items():
                if state != seen.get(task):
                    last_change = now
                    if state not in (None, "scheduled", "queued"):
                        progress(f"{now - started:6.0f}s  {task:<20} {state}")
            seen.update(states)
            stuck = stack_guard.stuck_queued_task(states, now - last_change, queued_bound)
            if stuck is not None:
                raise LoraflowError(self._never_started(dag_id, run_id, stuck, now - last_change))
            _, run = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
            if run.get("state") in TERMINAL:
                final: str = run["state"]
                return final
            time.sleep(3)
        unfinished = ", ".join(f"{t} {s}" for t, s in seen.items() if s not in ("success", "failed", "skipped"))
        raise LoraflowError(f"run {run_id} of {dag_id} did not finish within {timeout:.0f} s ({unfinished})")

    def _never_started(self, dag_id: str, run_id: str, task_id: str, waited: float) -> str:
        """What to say of a task its executor never started: its state, where its log will be, what to do."""
        _, ti = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")
        ti = ti if isinstance(ti, dict) else {}
        log = self.task_log_path(dag_id, run_id, task_id, int(ti.get("try_number") or 1))
        return (
            f"task {task_id} of {dag_id} run {run_id} is {ti.get('state', 'queued')} and has not started in "
            f"{waited:.0f} s, no other task of the run moving: its executor never took it. Its log: {log} "
            f"(written once it starts); the scheduler's: {self.home / 'logs' / 'scheduler.log'}. "
            "A stack left by an earlier stop, or its database, may hold it: `make clean` starts afresh"
        )

    def task_log_path(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """Where Airflow writes a try's log (its default ``log_filename_template``): under the stack's
        logs, or the remote log folder of the Celery workers."""
        root = self.env.get("AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER") or str(self.home / "logs")
        return f"{root}/dag_id={dag_id}/run_id={run_id}/task_id={task_id}/attempt={try_number}.log"

    def wait_for_logs(self, dag_id: str, run_id: str, tasks: list[str], timeout: float = 120) -> list[str]:
        """Wait until each task's last try has its log in the remote log folder, if the stack has one (the
        Celery workers'). A worker uploads a try's log once the task process ends, after the task reported
        its state, so a finished run's last logs trail it. Returns the tasks whose logs did not arrive."""
        root = self.env.get("AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER")
        if not root:
            return []
        deadline = time.monotonic() + timeout
        waiting = list(tasks)
        while waiting:
            for task_id in list(waiting):
                tries = self.task_tries(dag_id, run_id, task_id)
                if not tries:
                    continue
                last = int(tries[-1].get("try_number") or 1)
                bucket, name = gcs.split_uri(self.task_log_path(dag_id, run_id, task_id, last))
                if gcs.client().bucket(bucket).blob(name).exists():
                    waiting.remove(task_id)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(1)
        return waiting

    def fail_leftover_runs(self, started_at: datetime) -> list[str]:
        """Mark failed the runs an earlier stack left queued or running (stack_guard.leftover_runs): their
        processes are gone, and a new run should not share the stack with what is left of them. One line each."""
        status, body = self.call("GET", "/dags/~/dagRuns?state=queued&state=running&limit=100")
        if status != 200 or not isinstance(body, dict):
            return [f"could not list the runs an earlier stack may have left (HTTP {status}: {body})"]
        lines = []
        runs = body.get("dag_runs", [])
        for run in stack_guard.leftover_runs(runs, started_at):
            dag_id, run_id = run["dag_id"], run["dag_run_id"]
            status, answer = self.call("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", {"state": "failed"})
            if status == 200:
                lines.append(f"run {run_id} of {dag_id}, left {run['state']} by an earlier stack: marked failed")
            else:
                lines.append(f"run {run_id} of {dag_id} is left {run['state']} (HTTP {status} {answer}): `make clean`")
        return lines

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        status, body = self.call(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
        )
        return body.get("value") if status == 200 and isinstance(body, dict) else None

    def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every try of a task so far, oldest first: try_number, state, hostname (the worker that ran it), ..."""
        status, body = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")
        tries: list[dict[str, Any]] = body.get("task_instances", []) if status == 200 and isinstance(body, dict) else []
        return sorted(tries, key=lambda t: int(t.get("try_number") or 0))

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int | None = 1) -> str:
        """A try's log (``try_number`` None: the last try's)."""
        if try_number is None:
            status, ti = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")
            try_number = max(int(ti.get("try_number") or 1), 1) if status == 200 and isinstance(ti, dict) else 1
        status, body = self.call(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}?full_content=true"
        )
        if status != 200 or not isinstance(body, dict):
            return ""
        content = body.get("content", [])
        if isinstance(content, list):
            return "\n".join(str(c.get("event", c)) if isinstance(c, dict) else str(c) for c in content)
        return str(content)


@contextmanager
def local_stack(
    home: Path = DEMO_HOME,
    in_memory: bool = False,
    pipelines_dir: Path | None = None,
    database_url: str | None = None,
    parallelism: int = 4,
    celery: CeleryWorkers | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[LocalAirflow]:
    """The GCS emulator + Airflow, started and (always) stopped again, SIGTERM and SIGHUP included; one
    stack per ``home``, and what an earlier one left there ended first (``loraflow.dev.stack_guard``).
    ``database_url``, ``parallelism``, ``celery``: see ``LocalAirflow``. ``env``: added to the environment of
    every Airflow process of the stack (components, Celery workers, the broker, and so every task and step
    program), not to this process's (e.g. a fault to inject, a connection, OpenLineage's transport)."""
    with stack_guard.owned(home) as stop_begins:
        started_at = datetime.now(UTC)
        marker = stack_guard.marker_env(home)
        data = None if in_memory else home / "gcs"
        emulator = local_gcs.start("loraflow-demo", data, log=home / "gcs-emulator.log", env=marker)
        os.environ.update(emulator.env())
        gcs.client.cache_clear()
        airflow = LocalAirflow(
            home / "airflow",
            {**(env or {}), **emulator.env(), **marker},
            pipelines_dir=pipelines_dir,
            database_url=database_url,
            parallelism=parallelism,
            celery=celery,
        )
        try:
            say(f"GCS emulator on {emulator.host}; starting Airflow on {airflow.url} ...")
            airflow.start()
            for line in airflow.fail_leftover_runs(started_at):
                say(line)
            yield airflow
        finally:
            stop_begins()  # what runs of the stack now is ended last, if stopping its components leaves it
            airflow.stop()
            emulator.stop()


# ---------------------------------------------------------------------------------- reporting


def verdict(spec: PipelineSpec, airflow: LocalAirflow, run_id: str) -> dict[str, Any]:
    """What a person wants at the end of a run: metrics before and after, the decision, where it all is.
    ``gate`` is the gate's verdict read from its manifest's summary (a ``GateSummary``; None when the gate
    did not run; a summary loraflow did not write is a ``SummaryError`` naming the manifest), ``decision``
    that summary whole (its evidence: the guard's, the suites')."""
    results = {task: airflow.xcom(spec.name, run_id, task) for task in airflow.task_states(spec.name, run_id)}
    gate = results.get("gate") or {}
    decision = artifacts.read_manifest(gate["manifest"]).summary if gate else {}
    report = ((results.get("report") or {}).get("summary") or {}).get("report")
    return {
        "run_id": run_id,
        "base": (results.get("evaluate_base") or {}).get("summary", {}),
        "tuned": (results.get("evaluate_tuned") or {}).get("summary", {}),
        "gate": GateSummary.from_object(decision, f"the summary in {gate['manifest']}") if gate else None,
        "decision": decision,
        "published": (results.get("publish") or {}).get("summary"),
        "cached": sorted(t for t, r in results.items() if r and r.get("cached")),
        "artifacts": gcs.join(spec.artifact_root, spec.name, artifacts.safe_run_id(run_id)),
        "report": report,
        "report_url": browser_url(report, os.environ.get("STORAGE_EMULATOR_HOST")) if report else None,
    }


def save_report(v: dict[str, Any], folder: Path) -> Path | None:
    """A local copy of the run's report.html (verified against its manifest): ``folder/RUN.html``."""
    if not v.get("report"):
        return None
    prefix = v["report"].rsplit("/", 1)[0]
    manifest = artifacts.read_manifest(prefix)
    scratch = folder / ".download"
    artifacts.fetch(manifest, scratch, only=[REPORT_HTML])
    dest = folder / f"{artifacts.safe_run_id(v['run_id'])}.html"
    (scratch / REPORT_HTML).replace(dest)
    scratch.rmdir()
    return dest


def print_verdict(v: dict[str, Any]) -> None:
    gate: GateSummary | None = v["gate"]
    say("-" * 72)
    say(f"run {v['run_id']}")
    for name in [k for k in METRICS if k in v["base"] or k in v["tuned"]] or ["accuracy"]:
        say(f"{name} before SFT: {v['base'].get(name)}  after: {v['tuned'].get(name)}")
    if gate is None:
        say("gate: no decision (the gate did not run)")
    else:
        say(f"gate: {'PROMOTE' if gate.promote else 'do not promote'} - {gate.reason}")
    if v["published"]:
        say(f"published: {v['published']}")
    if v["cached"]:
        say(f"reused from the cache: {', '.join(v['cached'])}")
    say(f"artifacts: {v['artifacts']}/ (GCS emulator data in {DEMO_HOME / 'gcs'})")
    if v.get("report"):
        say(f"run report: {v['report']}")
        say(f"            {v['report_url']} (served while this stack runs)")


def prepare(spec_path: Path = TINY_SPEC, home: Path = DEMO_HOME, data_dir: Path | None = None) -> PipelineSpec:
    """Make the spec's tiny model (once) and upload it and the task's data (``data_dir``: another
    train.jsonl and eval.jsonl) where the spec reads them."""
    spec = load_spec(spec_path)
    name, tiny = tiny_model_for(spec)
    model = make_tiny_model(home / name, tiny)
    for line in seed_sources(spec_path, model, data_dir or tiny.data):
        say(line)
    return spec


@contextmanager
def demo_stack(celery_workers: int = 0) -> Iterator[LocalAirflow]:
    """The demo's stack: the LocalExecutor on SQLite, or ``celery_workers`` Celery workers with a Redis
    broker on a throwaway PostgreSQL (its database lasts as long as the stack; GCS data stays in .demo/gcs)."""
    if celery_workers <= 0:
        with local_stack() as airflow:
            yield airflow
        return
    with (
        stack_guard.owned(DEMO_HOME),  # the PostgreSQL server too is the stack's: ended if left behind
        local_postgres.running(env=stack_guard.marker_env(DEMO_HOME)) as url,
        local_stack(database_url=url, celery=CeleryWorkers(count=celery_workers)) as airflow,
    ):
        yield airflow


def cmd_run(args: argparse.Namespace) -> int:
    with demo_stack(args.celery_workers) as airflow:
        spec = prepare(args.spec)
        airflow.wait_for_dag(spec.name)
        conf = json.loads(args.conf)
        run_id = airflow.trigger(spec.name, conf)
        say(f"triggered {spec.name} run {run_id} with {conf or 'the spec defaults'}")
        state = airflow.wait_for_run(spec.name, run_id)
        v = verdict(spec, airflow, run_id)
        print_verdict(v)
        local = save_report(v, DEMO_HOME / "reports")
        say(f"run report saved to {local}" if local else "no run report (the run stopped before it)")
        say(f"run {state}; Airflow logs under {airflow.home / 'logs'}")
        return 0 if state == "success" else 1


def say_curves(logdir: str) -> None:
    """How to look at the curves under ``logdir``: TensorBoard on 127.0.0.1, reading the emulator."""
    tensorboard = str(Path(sys.executable).with_name("tensorboard"))
    say("training and evaluation curves (one TensorBoard run per stage and run) while this stack runs:")
    say("  " + tensorboard_command(tensorboard, logdir, os.environ.get("STORAGE_EMULATOR_HOST")))


def cmd_ui(args: argparse.Namespace) -> int:
    with demo_stack(args.celery_workers) as airflow:
        spec = prepare()
        airflow.wait_for_dag(spec.name)
        say(f"Airflow UI: {airflow.url}  user: admin  password: {airflow.password}")
        say(f"open {airflow.url}/dags/{spec.name}, press Trigger, change a parameter, run. Ctrl-C stops everything.")
        say_curves(gcs.join(spec.artifact_root, spec.name))
        try:
            while not airflow.exited():
                time.sleep(2)
            say(f"the {', '.join(airflow.exited())} exited (see {airflow.home / 'logs'}); stopping everything")
            return 1
        except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: the way to end `make ui`
            say(f"{stop or 'SIGINT'}: stopping everything")
            return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraflow.dev.demo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the tiny pipeline once on a local Airflow and print the verdict")
    r.add_argument("--conf", default="{}", help="trigger parameters as JSON, e.g. '{\"training_steps\": 100}'")
    r.add_argument(
        "--spec",
        type=Path,
        default=TINY_SPEC,
        help="the pipeline to run: pipelines/tiny-llama-lora.yaml (default) or pipelines/tiny-llama-qlora.yaml",
    )
    r.set_defaults(fn=cmd_run)
    u = sub.add_parser("ui", help="start GCS emulator + Airflow and keep them up for the web UI")
    u.set_defaults(fn=cmd_ui)
    for command in (r, u):
        command.add_argument(
            "--celery-workers",
            type=int,
            default=0,
            metavar="N",
            help="run Airflow distributed: the CeleryExecutor with N workers that share no disk, a Redis broker "
            "and a throwaway PostgreSQL (default 0: the LocalExecutor on SQLite)",
        )
    args = p.parse_args(argv)
    try:
        rc: int = args.fn(args)
        return rc
    except LoraflowError as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt as stop:  # the stack has stopped
        signum = stop.signum if isinstance(stop, stack_guard.StopSignal) else signal.SIGINT
        say(f"stopped by {signal.Signals(signum).name}")
        return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
