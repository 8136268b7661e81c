"""A run in Vertex AI Experiments (the spec's ``tracking.vertex``): its parameters, metrics and curves.

Through google-cloud-aiplatform's Experiments API: ``init(experiment=, experiment_tensorboard=)`` makes
the experiment on first use, backed by the spec's TensorBoard instance; each pipeline run is one
experiment run (:func:`experiment_run_name`), whose parameters and metrics the Experiments page
compares across runs and whose time series (lora_sft's and the evaluations' ``tensorboard/`` scalars,
one point per step) go to the backing TensorBoard. A retried report task resumes the run it made.
``LORAFLOW_VERTEX_ENDPOINT`` overrides the regional endpoint, as for the Vertex launcher and registry;
an ``http://`` one (the test stand-in) is called with anonymous credentials. The SDK is imported when a
run is logged, never at module import.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec.resource_names import vertex_api_host
from loraflow.spec.schema import VertexTrackingSpec

Curves = Mapping[str, Mapping[int, float]]  # tag -> step -> value


@dataclass(frozen=True)
class LoggedRun:
    name: str  # the experiment run's name
    url: str  # its page in the Cloud console


def experiment_run_name(run_id: str) -> str:
    """A Vertex AI run name for an Airflow run id: lowercase letters, digits and '-' (at most 63), with a
    digest of the id, so ids that differ only in other characters stay apart."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")[:54].strip("-")
    return f"{slug or 'run'}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


def run_url(settings: VertexTrackingSpec, name: str) -> str:
    """The experiment run's page in the Cloud console."""
    return (
        f"https://console.cloud.google.com/vertex-ai/experiments/locations/{settings.region}/experiments/"
        f"{settings.experiment}/runs/{settings.experiment}-{name}?project={settings.project}"
    )


def points_by_step(curves: Curves) -> dict[int, dict[str, float]]:
    """The curves as the Experiments API takes them: every tag's value at each step."""
    steps: dict[int, dict[str, float]] = {}
    for tag, points in curves.items():
        for step, value in points.items():
            steps.setdefault(step, {})[tag] = value
    return dict(sorted(steps.items()))


def log_run(
    settings: VertexTrackingSpec,
    run_id: str,
    params: Mapping[str, float | int | str],
    metrics: Mapping[str, float | int],
    curves: Curves,
) -> LoggedRun:
    """Log the pipeline run ``run_id`` to the spec's experiment; the run's name and console page. A refused
    call raises :class:`LoraflowError` naming the experiment, the answer and what to check."""
    from google.api_core.exceptions import GoogleAPICallError
    from google.cloud import aiplatform

    name = experiment_run_name(run_id)
    try:
        aiplatform.init(
            project=settings.project,
            location=settings.region,
            experiment=settings.experiment,
            experiment_tensorboard=settings.tensorboard,
            **_connection(settings.region),
        )
        made = aiplatform.ExperimentRun.get(name, experiment=settings.experiment) is not None
        aiplatform.start_run(name, resume=made)  # a retried report task resumes the run it made
        try:
            aiplatform.log_params(dict(params))
            aiplatform.log_metrics(dict(metrics))
            for step, values in points_by_step(curves).items():
                aiplatform.log_time_series_metrics(values, step=step)
        finally:
            aiplatform.end_run()
    except GoogleAPICallError as exc:
        raise LoraflowError(
            f"logging run {name} to Vertex AI experiment {settings.experiment} failed: {exc}. Check that "
            f"tracking.vertex.tensorboard ({settings.tensorboard}) exists and that the report's identity has "
            f"roles/aiplatform.user in {settings.project}; a retry resumes the run"
        ) from exc
    return LoggedRun(name, run_url(settings, name))


def _connection(region: str) -> dict[str, Any]:
    """``aiplatform.init``'s endpoint, transport and credentials: the regional endpoint, or the deployer's
    ``LORAFLOW_VERTEX_ENDPOINT`` (an ``http://`` one, the stand-in, without credentials)."""
    endpoint = os.environ.get("LORAFLOW_VERTEX_ENDPOINT") or vertex_api_host(region)
    connection: dict[str, Any] = {"api_endpoint": endpoint, "api_transport": "rest"}
    if endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials

        connection["credentials"] = AnonymousCredentials()
    return connection
