"""A Vertex AI stand-in for tests: the customJobs REST surface on 127.0.0.1, replicas as local processes.

The real google-cloud-aiplatform client (``JobServiceClient``, REST transport) is pointed at it with
``client_options={"api_endpoint": standin.url}`` and anonymous credentials; loraflow's launcher does
that when ``LORAFLOW_VERTEX_ENDPOINT`` is an ``http://`` URL.

What it does:
- v1 ``customJobs`` create (``POST /v1/projects/P/locations/L/customJobs``), get (``GET .../ID``),
  list with a label / display-name filter (``GET .../customJobs?filter=labels.k="v" AND ...``) and
  cancel (``POST .../ID:cancel``); unknown paths and bad bodies answer Google's error JSON.
- A job goes JOB_STATE_QUEUED -> PENDING -> RUNNING -> SUCCEEDED or FAILED, or CANCELLING ->
  CANCELLED when cancelled. RUNNING means ``replicaCount`` local processes per worker pool of the
  container's ``command + args``, ``python`` being the interpreter ``images`` maps the image URI to,
  each with the container's env plus what Vertex gives a replica: ``CLUSTER_SPEC`` (loopback
  addresses on free ports, one per replica), ``CLOUD_ML_JOB_ID``, ``AIP_MODEL_DIR``,
  ``AIP_CHECKPOINT_DIR``, ``AIP_TENSORBOARD_LOG_DIR``. ``host_env`` stands in for what the image and
  the metadata server provide (PATH, the GCS emulator's address, ...).
- A replica exiting non-zero fails the job (the others are killed) with an ``error.message`` of the
  shape Vertex uses ("The replica workerpool0-0 exited with a non-zero status of 1. ...") plus the
  replica's last error line; each replica's output goes to ``work_dir/job-ID/workerpool0-N.log``
  (its "Cloud Logging").

What it does not emulate: authentication and IAM (any credentials pass, the service account is
recorded but not enforced), quotas and TPU capacity (a job is never stuck QUEUED for lack of
chips), machine types and topologies (not validated: replicas are plain CPU processes), image
pulls (an image missing from ``images`` fails the job, nothing is pulled), networks, reservations,
scheduling / restart-on-failure, preemption, the long-running-operation and paging surfaces, list
filters beyond ``labels.K="V"`` / ``display_name="V"`` joined by AND, other APIs (model upload,
pipelines, hyperparameter tuning), persistence across restarts and the gRPC transport.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from loraflow.local_gcs import free_port

TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}
_JOBS = re.compile(r"^/v1/(projects/[^/]+/locations/[^/]+)/customJobs(?:/([^/:]+))?(:cancel)?$")
_TERM = re.compile(r'^\s*(labels\.[a-z][a-z0-9_-]*|display_name|displayName)\s*=\s*"([^"]*)"\s*$')


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Job:
    resource: dict[str, Any]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)


class ApiError(Exception):
    def __init__(self, code: int, status: str, message: str):
        super().__init__(message)
        self.code, self.status, self.message = code, status, message


class VertexStandIn:
    def __init__(
        self,
        images: Mapping[str, str],
        work_dir: Path,
        host_env: Mapping[str, str] = {},
        state_delay: float = 0.1,
    ) -> None:
        self.images = dict(images)
        self.work_dir = work_dir
        self.host_env = dict(host_env)
        self.state_delay = state_delay
        self.creates = 0  # create calls answered: a reattaching retry does not add one
        self.states: dict[str, list[str]] = {}  # job id -> every state it went through
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> VertexStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
            self._kill(job)
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> VertexStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def job(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._jobs[job_id].resource))

    # --- the REST surface -------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                try:
                    code, payload = standin._route(method, url.path, query, body)
                except ApiError as exc:
                    code, payload = (
                        exc.code,
                        {"error": {"code": exc.code, "message": exc.message, "status": exc.status}},
                    )
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        return Handler

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        m = _JOBS.match(path)
        if not m:
            raise ApiError(404, "NOT_FOUND", f"the stand-in does not serve {method} {path}")
        parent, job_id, cancel = m.groups()
        if method == "POST" and job_id is None:
            return 200, self._create(parent, body)
        if method == "GET" and job_id is None:
            return 200, self._list(parent, query.get("filter", [""])[0])
        with self._lock:
            job = self._jobs.get(job_id or "")
            if job is None or not job.resource["name"].startswith(parent + "/"):
                raise ApiError(404, "NOT_FOUND", f"CustomJob {parent}/customJobs/{job_id} does not exist")
            if method == "GET" and not cancel:
                return 200, json.loads(json.dumps(job.resource))
        if method == "POST" and cancel:
            self._cancel(job)
            return 200, {}
        raise ApiError(405, "UNIMPLEMENTED", f"{method} {path} is not a customJobs method")

    def _create(self, parent: str, body: bytes) -> dict[str, Any]:
        try:
            resource = json.loads(body)
            pools = resource["jobSpec"]["workerPoolSpecs"]
            display_name = resource["displayName"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, "INVALID_ARGUMENT", f"bad CustomJob: {type(exc).__name__} {exc}") from None
        if not display_name or not pools:
            raise ApiError(400, "INVALID_ARGUMENT", "displayName and jobSpec.workerPoolSpecs are required")
        with self._lock:
            self.creates += 1
            job_id = str(1000 + self.creates)
            now = _now()
            resource |= {
                "name": f"{parent}/customJobs/{job_id}",
                "state": "JOB_STATE_QUEUED",
                "createTime": now,
                "updateTime": now,
            }
            job = _Job(resource)
            self._jobs[job_id] = job
            self.states[job_id] = ["JOB_STATE_QUEUED"]
        threading.Thread(target=self._drive, args=(job_id, job), daemon=True).start()
        return json.loads(json.dumps(resource))

    def _list(self, parent: str, filter_: str) -> dict[str, Any]:
        terms = []
        for raw in filter(None, re.split(r"\s+AND\s+", filter_.strip())):
            m = _TERM.match(raw)
            if not m:
                raise ApiError(400, "INVALID_ARGUMENT", f"the stand-in cannot filter on {raw!r}")
            terms.append(m.groups())

        def matches(r: dict[str, Any]) -> bool:
            for key, value in terms:
                got = r.get("labels", {}).get(key[7:]) if key.startswith("labels.") else r.get("displayName")
                if got != value:
                    return False
            return True

        with self._lock:
            found = [
                json.loads(json.dumps(j.resource))
                for j in self._jobs.values()
                if j.resource["name"].startswith(parent + "/") and matches(j.resource)
            ]
        return {"customJobs": found} if found else {}

    def _cancel(self, job: _Job) -> None:
        with self._lock:
            if job.resource["state"] in TERMINAL:
                return
            self._set(job, "JOB_STATE_CANCELLING")
            job.cancel.set()
        self._kill(job)

    # --- running a job ----------------------------------------------------------------------------

    def _set(self, job: _Job, state: str, **fields: Any) -> None:
        """Called with the lock held."""
        job.resource |= {"state": state, "updateTime": _now(), **fields}
        self.states[job.resource["name"].rsplit("/", 1)[1]].append(state)

    def _finish(self, job: _Job, state: str, **fields: Any) -> None:
        with self._lock:
            if job.cancel.is_set():
                state, fields = "JOB_STATE_CANCELLED", {"error": {"code": 1, "message": "CANCELED"}}
            self._set(job, state, endTime=_now(), **fields)

    def _kill(self, job: _Job) -> None:
        for proc in job.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in job.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def _drive(self, job_id: str, job: _Job) -> None:
        for state in ("JOB_STATE_PENDING", "JOB_STATE_RUNNING"):
            if job.cancel.wait(self.state_delay):
                return self._finish(job, "JOB_STATE_CANCELLED")
            with self._lock:
                if job.cancel.is_set():  # cancelled between the wait and the lock
                    self._set(job, "JOB_STATE_CANCELLED", endTime=_now(), error={"code": 1, "message": "CANCELED"})
                    return None
                if state == "JOB_STATE_RUNNING":
                    error = self._start_replicas(job_id, job)
                    if error:
                        self._set(job, "JOB_STATE_FAILED", endTime=_now(), error={"code": 3, "message": error})
                        return None
                    self._set(job, state, startTime=_now())
                else:
                    self._set(job, state)
        while True:
            codes = [p.poll() for p in job.procs]
            failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed and not job.cancel.is_set():
                i, rc = failed[0]
                self._kill(job)
                log = self.work_dir / f"job-{job_id}" / f"workerpool0-{i}.log"
                lines = log.read_text(errors="replace").splitlines() if log.exists() else []
                last = next((t for t in reversed(lines) if "Error" in t or "ERROR" in t), lines[-1] if lines else "")
                message = (
                    f"The replica workerpool0-{i} exited with a non-zero status of {rc}. "
                    f"Termination reason: Error. {last.strip()}"
                )
                return self._finish(job, "JOB_STATE_FAILED", error={"code": 3, "message": message})
            if all(rc is not None for rc in codes):
                return self._finish(job, "JOB_STATE_SUCCEEDED")
            time.sleep(0.05)

    def _start_replicas(self, job_id: str, job: _Job) -> str | None:
        """Start every replica; a message when the job cannot start (lock held)."""
        spec = job.resource["jobSpec"]
        pools = spec["workerPoolSpecs"]
        cluster = {
            f"workerpool{p}": [f"127.0.0.1:{free_port()}" for _ in range(int(pool.get("replicaCount", 1)))]
            for p, pool in enumerate(pools)
        }
        base = spec.get("baseOutputDirectory", {}).get("outputUriPrefix", "").rstrip("/")
        logs = self.work_dir / f"job-{job_id}"
        logs.mkdir(parents=True, exist_ok=True)
        for p, pool in enumerate(pools):
            container = pool.get("containerSpec", {})
            image = container.get("imageUri", "")
            if image not in self.images:
                return f"Unable to pull the container image {image!r}: not found (the stand-in knows {sorted(self.images)})"
            command = [*container.get("command", []), *container.get("args", [])]
            if command and command[0] == "python":
                command[0] = self.images[image]
            for r in range(int(pool.get("replicaCount", 1))):
                env = dict(self.host_env)
                env |= {e["name"]: e.get("value", "") for e in container.get("env", [])}
                env |= {
                    "CLUSTER_SPEC": json.dumps(
                        {"cluster": cluster, "environment": "cloud", "task": {"type": f"workerpool{p}", "index": r}}
                    ),
                    "CLOUD_ML_JOB_ID": job_id,
                }
                if base:
                    env |= {
                        "AIP_MODEL_DIR": f"{base}/model/",
                        "AIP_CHECKPOINT_DIR": f"{base}/checkpoints/",
                        "AIP_TENSORBOARD_LOG_DIR": f"{base}/logs/",
                    }
                out = open(logs / f"workerpool{p}-{r}.log", "wb")
                job.procs.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=str(self.work_dir),
                        start_new_session=True,
                    )
                )
                out.close()
        return None
