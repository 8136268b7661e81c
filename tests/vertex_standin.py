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
  the metadata server provide (PATH, the GCS emulator's address, ...). Each replica is a separate
  host: its own HOME, TMPDIR, scratch and working directory (``tests/separate_hosts.py``), so replicas
  share nothing but GCS, as on a TPU slice.
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
The Model Registry surface (``ModelRegistryStandIn``, ``standin.models``) is described there; Experiments
and TensorBoard (``serve_tracking``) in tests/vertex_tracking_standin.py.
``faults`` lets a test make the next requests fail with a given HTTP status (a transient outage);
``routes`` is the list of served APIs, one (pattern, handler) pair each.
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

from loraflow.dev.local_gcs import free_port
from tests.separate_hosts import host_dirs

TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}
_JOBS = re.compile(r"^/v1/(projects/[^/]+/locations/[^/]+)/customJobs(?:/([^/:]+))?(:cancel)?$")
# The aiplatform client polls long-running operations on /ui/{name}, as Vertex serves them; the rest on /v1.
_MODELS = re.compile(
    r"^/(?:v1|ui)/(projects/[^/]+/locations/[^/]+)/models"
    r"(?:(:upload)|/([^/:]+)(?:(:listVersions|:mergeVersionAliases)|/operations/([^/:]+))?)?$"
)
_TERM = re.compile(r'^\s*(labels\.[a-z][a-z0-9_-]*|display_name|displayName)\s*=\s*"([^"]*)"\s*$')


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _filter_terms(filter_: str) -> list[tuple[str, str]]:
    """The ``key="value"`` terms of a list filter joined by AND (all the launcher and registry send)."""
    terms = []
    for raw in filter(None, re.split(r"\s+AND\s+", filter_.strip())):
        m = _TERM.match(raw)
        if not m:
            raise ApiError(400, "INVALID_ARGUMENT", f"the stand-in cannot filter on {raw!r}")
        terms.append(m.groups())
    return terms


def _matches(resource: dict[str, Any], terms: list[tuple[str, str]]) -> bool:
    for key, value in terms:
        got = resource.get("labels", {}).get(key[7:]) if key.startswith("labels.") else resource.get("displayName")
        if got != value:
            return False
    return True


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
        port: int = 0,
    ) -> None:
        """``port``: where it listens on 127.0.0.1 (0: a free port the kernel picks)."""
        self.images = dict(images)
        self.work_dir = work_dir
        self.host_env = dict(host_env)
        self.state_delay = state_delay
        self.creates = 0  # create calls answered: a reattaching retry does not add one
        self.states: dict[str, list[str]] = {}  # job id -> every state it went through
        self._jobs: dict[str, _Job] = {}
        # (HTTP code, status) answered to the next requests instead of serving them: transient API errors.
        self.faults: list[tuple[int, str]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        # (path pattern, handler(method, match, query, body) -> (HTTP code, JSON)): one pair per API served.
        self.routes: list[tuple[re.Pattern[str], Any]] = [(_JOBS, self._custom_jobs)]
        self.models = ModelRegistryStandIn(state_delay)  # Model Registry: models:upload, get, list, aliases
        self.routes.append((_MODELS, self.models.route))
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> VertexStandIn:
        self._thread.start()
        return self

    def serve_tracking(self, project: str, location: str) -> Any:
        """Serve Vertex AI Experiments and TensorBoard for ``project`` and ``location``
        (tests/vertex_tracking_standin.py); the ``TrackingStandIn``, to make TensorBoards and read back."""
        from tests.vertex_tracking_standin import PATH, TrackingStandIn

        tracking = TrackingStandIn(project, location)
        self.routes.append((PATH, tracking.route))
        return tracking

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

    def pause(self, job_id: str) -> None:
        """Stop (SIGSTOP) every replica of a running job: it stays RUNNING, computing nothing, until it is
        cancelled (a test that needs a long job only to be running, not its work)."""
        with self._lock:
            procs = list(self._jobs[job_id].procs)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGSTOP)

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

            def do_PATCH(self) -> None:
                self._answer("PATCH")

        return Handler

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        """Dispatch to the first of ``self.routes`` whose pattern matches the path (add a pair for a new API)."""
        with self._lock:
            self.requests.append((method, path))
            if self.faults:
                code, status = self.faults.pop(0)
                raise ApiError(code, status, f"injected by the test: {status}")
        for pattern, handler in self.routes:
            m = pattern.match(path)
            if m:
                return handler(method, m, query, body)
        raise ApiError(404, "NOT_FOUND", f"the stand-in does not serve {method} {path}")

    def _custom_jobs(self, method: str, m: re.Match[str], query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
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
        raise ApiError(405, "UNIMPLEMENTED", f"{method} {m.group(0)} is not a customJobs method")

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
        terms = _filter_terms(filter_)

        with self._lock:
            found = [
                json.loads(json.dumps(j.resource))
                for j in self._jobs.values()
                if j.resource["name"].startswith(parent + "/") and _matches(j.resource, terms)
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
                    os.killpg(proc.pid, signal.SIGCONT)  # a paused replica takes its SIGTERM
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
                disk, cwd = host_dirs(logs / "hosts", f"workerpool{p}-{r}")  # a host shares no disk
                env |= disk
                out = open(logs / f"workerpool{p}-{r}.log", "wb")
                job.procs.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=str(cwd),
                        start_new_session=True,
                    )
                )
                out.close()
        return None


def replica_env(repo: Path, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """What a replica of the stand-in needs from "the image": PATH, the repository on PYTHONPATH, CPU JAX."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return env | {"PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"} | dict(extra)


def endpoint_env(standin: VertexStandIn | str, poll_seconds: float) -> dict[str, str]:
    """The environment that points loraflow's launcher and trigger at the stand-in (or at its URL, for one
    that starts later)."""
    return {
        "LORAFLOW_VERTEX_ENDPOINT": standin if isinstance(standin, str) else standin.url,
        "LORAFLOW_VERTEX_PROJECT": "loraflow-local",
        "LORAFLOW_VERTEX_POLL_SECONDS": str(poll_seconds),
    }


class ModelRegistryStandIn:
    """Vertex AI Model Registry's v1 REST surface, in memory (``VertexStandIn.models``).

    What it does: ``models:upload`` (``POST .../models:upload`` with ``modelId`` for a new model or
    ``parentModel`` for a new version of one) answers a long-running operation
    (``.../models/ID/operations/N``) that is done once ``state_delay`` seconds passed and it was polled
    once already (the first poll always finds it running, whatever the machine's load: a client that
    takes the upload's answer for done fails, and ``polls`` is at least 2), polled with ``GET`` on its name, whose response is an ``UploadModelResponse``; ``models`` get (``.../models/ID``,
    ``ID@VERSION`` or ``ID@ALIAS``; the default version without one), list (``?filter=labels.k="v"``,
    default versions only), ``:listVersions`` and ``ID@VERSION:mergeVersionAliases`` (``-alias``
    removes one). As Vertex does, a model's first version carries the ``default`` alias, an alias is
    unique within a model (given to a version, it leaves the one that held it), ``default`` never
    leaves a model, and version ids count from 1.

    What it does not emulate: the model's artifacts (``artifactUri`` is recorded, never read),
    container checks, deployment, model deletion, paging, other filters and field masks.
    ``uploads`` keeps every upload request body as sent; ``polls`` counts operation GETs.
    """

    def __init__(self, state_delay: float = 0.1) -> None:
        self.state_delay = state_delay
        self.uploads: list[dict[str, Any]] = []
        self.polls = 0
        self._versions: dict[str, list[dict[str, Any]]] = {}  # model name -> its versions, oldest first
        self._operations: dict[str, tuple[float, dict[str, Any]]] = {}  # name -> (done at, operation)
        self._polled: set[str] = set()  # operations polled at least once
        self._lock = threading.Lock()

    def versions(self, model_name: str) -> list[dict[str, Any]]:
        with self._lock:
            return json.loads(json.dumps(self._versions.get(model_name, [])))

    def route(self, method: str, m: re.Match[str], query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        parent, upload, model, verb, operation = (urllib.parse.unquote(g) if g else g for g in m.groups())
        if method == "POST" and upload:
            return 200, self._upload(parent, body)
        if method == "GET" and model is None and not upload:
            return 200, self._list(parent, query.get("filter", [""])[0])
        if model is None:
            raise ApiError(405, "UNIMPLEMENTED", f"{method} on models is not a Model Registry method")
        model_id, _, ref = model.partition("@")
        name = f"{parent}/models/{model_id}"
        with self._lock:
            if name not in self._versions:
                raise ApiError(404, "NOT_FOUND", f"Model {name} does not exist")
            if operation is not None and method == "GET":
                return 200, self._poll(f"{name}/operations/{operation}")
            if verb == ":listVersions" and method == "GET" and not ref:
                return 200, {"models": json.loads(json.dumps(self._versions[name]))}
            version = self._find(name, ref)
            if verb == ":mergeVersionAliases" and method == "POST" and ref:
                try:
                    aliases = list(json.loads(body or b"{}").get("versionAliases") or [])
                except ValueError as exc:
                    raise ApiError(400, "INVALID_ARGUMENT", f"bad request: {exc}") from None
                self._merge_aliases(name, version, aliases)
                return 200, json.loads(json.dumps(version))
            if verb is None and method == "GET":
                return 200, json.loads(json.dumps(version))
        raise ApiError(405, "UNIMPLEMENTED", f"{method} {m.group(0)} is not a Model Registry method")

    def _find(self, name: str, ref: str) -> dict[str, Any]:
        """A version by id or alias (lock held); the default version when ``ref`` is empty."""
        wanted = ref or "default"
        for v in self._versions[name]:
            if v["versionId"] == wanted or wanted in v["versionAliases"]:
                return v
        raise ApiError(404, "NOT_FOUND", f"Model {name}@{ref} does not exist (no such version id or alias)")

    def _merge_aliases(self, name: str, version: dict[str, Any], aliases: list[str]) -> None:
        for alias in aliases:
            drop = alias.startswith("-")
            alias = alias.lstrip("-")
            if not _ALIAS.match(alias) or alias.isdigit():
                raise ApiError(400, "INVALID_ARGUMENT", f"{alias!r} is not a valid version alias")
            if drop:
                if alias == "default":
                    raise ApiError(400, "INVALID_ARGUMENT", "the default alias cannot be removed, only moved")
                version["versionAliases"] = [a for a in version["versionAliases"] if a != alias]
                continue
            for other in self._versions[name]:  # an alias is unique within a model: it moves
                if other is not version and alias in other["versionAliases"]:
                    other["versionAliases"].remove(alias)
                    other["versionUpdateTime"] = _now()
            if alias not in version["versionAliases"]:
                version["versionAliases"].append(alias)
        version["versionUpdateTime"] = _now()

    def _upload(self, parent: str, body: bytes) -> dict[str, Any]:
        try:
            request = json.loads(body)
            resource = dict(request["model"])
            display_name = resource["displayName"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, "INVALID_ARGUMENT", f"bad UploadModelRequest: {type(exc).__name__} {exc}") from None
        if not display_name or not resource.get("containerSpec", {}).get("imageUri"):
            raise ApiError(400, "INVALID_ARGUMENT", "model.displayName and model.containerSpec.imageUri are required")
        aliases = [str(a) for a in resource.get("versionAliases") or []]
        bad = [a for a in aliases if not _ALIAS.match(a) or a.isdigit()]
        if bad:
            raise ApiError(400, "INVALID_ARGUMENT", f"{bad} are not valid version aliases")
        with self._lock:
            self.uploads.append(request)
            if request.get("parentModel"):
                name = request["parentModel"]
                if not name.startswith(parent + "/models/") or name not in self._versions:
                    raise ApiError(404, "NOT_FOUND", f"parent model {name} does not exist")
            else:
                model_id = request.get("modelId") or str(len(self._versions) + 1000)
                name = f"{parent}/models/{model_id}"
                if name in self._versions:
                    raise ApiError(409, "ALREADY_EXISTS", f"Model {name} already exists; upload with parentModel")
                self._versions[name] = []
            versions = self._versions[name]
            now = _now()
            version = resource | {
                "name": name,
                "versionId": str(len(versions) + 1),
                "versionAliases": [],
                "createTime": versions[0]["createTime"] if versions else now,
                "updateTime": now,
                "versionCreateTime": now,
                "versionUpdateTime": now,
            }
            versions.append(version)
            self._merge_aliases(name, version, (["default"] if len(versions) == 1 else []) + aliases)
            op_name = f"{name}/operations/{len(self._operations) + 1}"
            operation = {
                "name": op_name,
                "metadata": {
                    "@type": "type.googleapis.com/google.cloud.aiplatform.v1.UploadModelOperationMetadata",
                    "genericMetadata": {"createTime": now, "updateTime": now},
                },
                "done": False,
            }
            self._operations[op_name] = (
                time.monotonic() + self.state_delay,
                operation
                | {
                    "done": True,
                    "response": {
                        "@type": "type.googleapis.com/google.cloud.aiplatform.v1.UploadModelResponse",
                        "model": name,
                        "modelVersionId": version["versionId"],
                    },
                },
            )
            return operation

    def _poll(self, op_name: str) -> dict[str, Any]:
        """An operation's state (lock held): done once its delay passed and it was polled before."""
        self.polls += 1
        if op_name not in self._operations:
            raise ApiError(404, "NOT_FOUND", f"Operation {op_name} does not exist")
        done_at, finished = self._operations[op_name]
        first = op_name not in self._polled
        self._polled.add(op_name)
        if first or time.monotonic() < done_at:
            return {k: v for k, v in finished.items() if k != "response"} | {"done": False}
        return json.loads(json.dumps(finished))

    def _list(self, parent: str, filter_: str) -> dict[str, Any]:
        terms = _filter_terms(filter_)
        with self._lock:
            found = []
            for name, versions in self._versions.items():
                if not name.startswith(parent + "/models/") or not versions:
                    continue
                default = self._find(name, "")
                if _matches(default, terms):
                    found.append(json.loads(json.dumps(default)))
        return {"models": found} if found else {}


_ALIAS = re.compile(r"^[a-z][a-zA-Z0-9-]{0,126}[a-z0-9-]$")
