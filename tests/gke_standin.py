"""A Kubernetes API stand-in for the GKE launcher's tests: JobSet custom objects and pods on 127.0.0.1.

The real kubernetes client (``CustomObjectsApi``, ``CoreV1Api``) is pointed at it through a
``Configuration`` whose host is ``standin.url``; loraflow's launcher does that when
``LORAFLOW_GKE_ENDPOINT`` is set.

What it does:
- ``/apis/jobset.x-k8s.io/v1alpha2/namespaces/NS/jobsets``: create (POST; 409 ``AlreadyExists``
  when the name is taken, 422 ``Invalid`` when apiVersion/kind/name/namespace do not fit the path),
  get (GET ``.../NAME``) and delete (DELETE ``.../NAME``; the ``propagationPolicy`` is recorded),
  answering Kubernetes ``Status`` objects for errors. Created objects get a uid, a
  creationTimestamp and an empty status.
- ``/api/v1/namespaces/NS/pods?labelSelector=k=v``: lists the pods a test put there.
- ``faults``: HTTP statuses the next requests answer instead (a transient outage).

What it does not emulate: a JobSet controller (nothing creates Jobs, pods or the headless service;
a JobSet's status changes only when a test calls ``set_status``), scheduling, TPU node pools, quotas,
image pulls, admission webhooks and schema validation (the tests check the object against the
Kubernetes models separately), foreground deletion's wait for the pods (deletion is immediate),
resourceVersion conflicts, watches, label selectors other than ``k=v``, authentication and RBAC,
and every other API.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_JOBSETS = re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class GkeStandIn:
    def __init__(self) -> None:
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[str, list[dict[str, Any]]] = {}
        self.calls: list[tuple[str, str]] = []  # (method, path) of every request
        self.created = 0  # JobSets stored so far (set_status may be called once this counts them)
        self.deletions: list[dict[str, Any]] = []  # the delete options bodies received
        self.faults: list[int] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())  # the kernel picks a free port
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # --- what a test drives ---------------------------------------------------------------------

    def creates(self) -> int:
        """Create requests received (a POST is counted before its JobSet is stored: wait on ``created``)."""
        return sum(1 for method, _ in self.calls if method == "POST")

    def set_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        with self._lock:
            self.jobsets[(namespace, name)]["status"] = status

    def add_pod(self, namespace: str, jobset: str, index: int, exit_code: int, message: str) -> None:
        terminated = {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed", "message": message}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{jobset}-workers-0-{index}-abcde",
                "namespace": namespace,
                "labels": {"jobset.sigs.k8s.io/jobset-name": jobset},
            },
            "status": {
                "phase": "Failed" if exit_code else "Succeeded",
                "containerStatuses": [
                    {
                        "name": "step",
                        "image": "img",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": terminated},
                    }
                ],
            },
        }
        with self._lock:
            self.pods.setdefault(namespace, []).append(pod)

    # --- the server -----------------------------------------------------------------------------

    def __enter__(self) -> GkeStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}") if n else {}

            def _route(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                body = self._body() if method in ("POST", "DELETE") else {}
                with standin._lock:
                    standin.calls.append((method, url.path))
                    fault = standin.faults.pop(0) if standin.faults else None
                if fault is not None:
                    self._send(fault, _status(fault, "ServiceUnavailable", "injected fault"))
                    return
                m = _JOBSETS.match(url.path)
                if m:
                    self._send(*standin._jobsets(method, m.group(1), m.group(2), body))
                    return
                m = _PODS.match(url.path)
                if m and method == "GET":
                    selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                    key, _, value = selector.partition("=")
                    with standin._lock:
                        pods = [
                            p for p in standin.pods.get(m.group(1), []) if p["metadata"]["labels"].get(key) == value
                        ]
                    self._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods})
                    return
                self._send(
                    404, _status(404, "NotFound", f"the server could not find the requested resource {url.path}")
                )

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler

    def _jobsets(self, method: str, namespace: str, name: str | None, body: dict[str, Any]) -> tuple[int, dict]:
        with self._lock:
            if method == "POST" and name is None:
                meta = body.get("metadata") or {}
                new_name = meta.get("name")
                if body.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or body.get("kind") != "JobSet":
                    return 422, _status(422, "Invalid", f"not a jobset.x-k8s.io/v1alpha2 JobSet: {body.get('kind')}")
                if not new_name or meta.get("namespace", namespace) != namespace:
                    return 422, _status(422, "Invalid", "metadata.name missing or metadata.namespace not the path's")
                if (namespace, new_name) in self.jobsets:
                    return 409, _status(409, "AlreadyExists", f'jobsets.jobset.x-k8s.io "{new_name}" already exists')
                stored = json.loads(json.dumps(body))
                stored["metadata"] |= {
                    "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "resourceVersion": "1",
                    "creationTimestamp": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
                stored["status"] = {}
                self.jobsets[(namespace, new_name)] = stored
                self.created += 1
                return 201, stored
            if name is None:
                return 405, _status(405, "MethodNotAllowed", f"{method} on the collection")
            obj = self.jobsets.get((namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'jobsets.jobset.x-k8s.io "{name}" not found')
            if method == "GET":
                return 200, obj
            if method == "DELETE":
                self.deletions.append(body)
                del self.jobsets[(namespace, name)]
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}
            return 405, _status(405, "MethodNotAllowed", method)


@contextmanager
def serve() -> Iterator[GkeStandIn]:
    with GkeStandIn() as standin:
        yield standin
