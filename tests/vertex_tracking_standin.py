"""Vertex AI Experiments and Vertex AI TensorBoard, as the stand-in (tests/vertex_standin.py) serves them.

What google-cloud-aiplatform calls (REST transport) for ``init(experiment=, experiment_tensorboard=)``,
``start_run``, ``log_params``, ``log_metrics``, ``log_time_series_metrics`` and ``end_run``:

- the Metadata store: ``metadataStores`` (create answers a finished operation), its ``contexts`` (the
  experiment, its runs), ``artifacts`` (the run's TensorBoard run), ``:addContextChildren``,
  ``:addContextArtifactsAndExecutions``; get, create with an id, patch (params, metrics, state).
- TensorBoard: ``tensorboards/ID`` (only the instances a test made exist), its ``experiments``, their
  ``runs``, a run's ``timeSeries`` (ids chosen here) and ``runs/ID:write`` (scalar points).

What Vertex enforces and the stand-in does too: a resource outside the run's project and region is
refused (403, as an identity with rights in one project only gets); ids of contexts, artifacts,
TensorBoard experiments and runs are 1-128 lowercase letters, digits and '-' starting with a letter
or digit (400 otherwise); creating an existing id is 409; an experiment's backing TensorBoard lies in
the experiment's project and region (400 otherwise); a missing resource is 404; a point written to a
time series that does not exist is 404.
What it does not: IAM, list filters and paging (a list answers every child), executions, lineage
queries, deletes, TensorBoard blobs and tensors (only scalars are written here).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from typing import Any

from tests.vertex_standin import ApiError

PATH = re.compile(r"^/(?:v1|ui)/projects/([^/]+)/locations/([^/]+)/((?:metadataStores|tensorboards)(?:/[^?]*)?)$")
_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")
_COLLECTIONS = {"metadataStores", "contexts", "artifacts", "tensorboards", "experiments", "runs", "timeSeries"}
_ID_PARAMS = ("metadataStoreId", "contextId", "artifactId", "tensorboardExperimentId", "tensorboardRunId")


class TrackingStandIn:
    """Experiments and TensorBoard resources of one project and region, in memory."""

    def __init__(self, project: str, location: str) -> None:
        self.project, self.location = project, location
        self.parent = f"projects/{project}/locations/{location}"
        self.resources: dict[str, dict[str, Any]] = {}  # full name -> resource
        self.children: dict[str, list[str]] = {}  # context -> child contexts and artifacts added to it
        self.points: dict[str, dict[int, float]] = {}  # time series name -> step -> value
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add_tensorboard(self, tensorboard_id: str) -> str:
        """A TensorBoard instance (created in the console, as users do); its resource name."""
        name = f"{self.parent}/tensorboards/{tensorboard_id}"
        self.resources[name] = {"name": name, "displayName": f"tensorboard {tensorboard_id}"}
        return name

    # --- what tests read back ----------------------------------------------------------------------

    def context(self, context_id: str) -> dict[str, Any]:
        return copy.deepcopy(self.resources[f"{self.parent}/metadataStores/default/contexts/{context_id}"])

    def scalars(self, tensorboard_run: str) -> dict[str, dict[int, float]]:
        """The scalar points of a TensorBoard run (its full name), by time series display name."""
        series = {n: r for n, r in self.resources.items() if n.startswith(f"{tensorboard_run}/timeSeries/")}
        return {r["displayName"]: dict(self.points.get(n, {})) for n, r in series.items()}

    # --- the REST surface --------------------------------------------------------------------------

    def route(self, method: str, m: re.Match[str], query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        """The answer to a request whose path ``PATH`` matched."""
        project, location, rest = m.groups()
        if (project, location) != (self.project, self.location):
            raise ApiError(
                403, "PERMISSION_DENIED", f"projects/{project}/locations/{location} is not the run's {self.parent}"
            )
        name, verb = f"{self.parent}/{rest}".partition(":")[::2]
        payload = json.loads(body) if body else {}
        with self._lock:
            if verb:
                return 200, self._verb(name, verb, payload)
            if method == "GET":
                return 200, self._get(name)
            if method == "POST":
                return 200, self._create(name, query, payload)
            if method == "PATCH":
                return 200, self._patch(name, payload)
        raise ApiError(405, "UNIMPLEMENTED", f"{method} {m.group(0)}")

    def _get(self, name: str) -> dict[str, Any]:
        if name.rsplit("/", 1)[-1] in _COLLECTIONS:  # a list: every child
            kids = [copy.deepcopy(r) for n, r in self.resources.items() if n.rsplit("/", 1)[0] == name]
            return {_list_key(name): kids} if kids else {}
        return copy.deepcopy(self._existing(name))

    def _existing(self, name: str) -> dict[str, Any]:
        if name not in self.resources:
            raise ApiError(404, "NOT_FOUND", f"{name} does not exist")
        return self.resources[name]

    def _create(self, collection: str, query: dict[str, list[str]], payload: dict[str, Any]) -> dict[str, Any]:
        parent = collection.rsplit("/", 1)[0]
        if parent != self.parent:
            self._existing(parent)
        given = next((query[p][0] for p in _ID_PARAMS if p in query), None)
        if given is not None and not _ID.fullmatch(given):
            raise ApiError(400, "INVALID_ARGUMENT", f"id {given!r} must match {_ID.pattern}")
        name = f"{collection}/{given or next(self._ids)}"
        if name in self.resources:
            raise ApiError(409, "ALREADY_EXISTS", f"{name} already exists")
        resource = {**payload, "name": name}
        self._check_backing(resource)
        self.resources[name] = resource
        if collection.endswith("/metadataStores"):  # a long-running operation, answered finished
            response = {**resource, "@type": "type.googleapis.com/google.cloud.aiplatform.v1.MetadataStore"}
            return {"name": f"{name}/operations/{next(self._ids)}", "done": True, "response": response}
        return copy.deepcopy(resource)

    def _patch(self, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        resource = self._existing(name)
        updated = {**resource, **payload, "name": name}
        self._check_backing(updated)
        self.resources[name] = updated
        return copy.deepcopy(updated)

    def _check_backing(self, resource: dict[str, Any]) -> None:
        """An experiment's backing TensorBoard exists, in the experiment's project and region."""
        backing = (resource.get("metadata") or {}).get("backing_tensorboard_resource")
        if backing is None:
            return
        if not backing.startswith(self.parent + "/tensorboards/"):
            raise ApiError(400, "INVALID_ARGUMENT", f"backing TensorBoard {backing} is not in {self.parent}")
        self._existing(backing)

    def _verb(self, name: str, verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._existing(name)
        if verb == "addContextChildren":
            added = payload.get("childContexts", [])
        elif verb == "addContextArtifactsAndExecutions":
            added = [*payload.get("artifacts", []), *payload.get("executions", [])]
        elif verb == "write":
            self._write(name, payload)
            return {}
        else:
            raise ApiError(400, "INVALID_ARGUMENT", f"the stand-in does not serve :{verb}")
        for child in added:
            self._existing(child)
        self.children.setdefault(name, []).extend(added)
        return {}

    def _write(self, run: str, payload: dict[str, Any]) -> None:
        """``runs/ID:write``: scalar points of the run's time series."""
        for data in payload.get("timeSeriesData", []):
            series = f"{run}/timeSeries/{data['tensorboardTimeSeriesId']}"
            self._existing(series)
            for value in data.get("values", []):  # proto3 JSON leaves out zeros: step 0, a value of 0.0
                step, scalar = int(value.get("step", 0)), float(value.get("scalar", {}).get("value", 0.0))
                self.points.setdefault(series, {})[step] = scalar


def _list_key(collection: str) -> str:
    """The list response's field: ``contexts``, ``tensorboardExperiments``, ``tensorboardTimeSeries`` ..."""
    last = collection.rsplit("/", 1)[-1]
    return {
        "experiments": "tensorboardExperiments",
        "runs": "tensorboardRuns",
        "timeSeries": "tensorboardTimeSeries",
    }.get(last, last)
