"""The deferrable operator path against the stand-in, without a scheduler: execute() submits and defers to
the trigger, the trigger's event resumes execute_complete(), which returns the non-deferred XCom."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev import local_gcs
from loraflow.errors import StepError
from loraflow.pipeline import runner
from loraflow.spec.schema import PipelineSpec, with_overrides
from loraflow.storage import artifacts
from operators.links import ArtifactsLink, WorkloadLink
from operators.stages import OPERATORS
from operators.triggers import VertexJobTrigger
from tests.control.test_vertex_launcher import compute, serve
from tests.vertex_standin import VertexStandIn


@pytest.fixture
def standin(
    tmp_path: Path, gcs_emulator: local_gcs.Emulator, monkeypatch: pytest.MonkeyPatch
) -> Iterator[VertexStandIn]:
    yield from serve(tmp_path, gcs_emulator, monkeypatch)


class FakeTI:
    def __init__(self) -> None:
        self.pushed: dict[str, Any] = {}

    def xcom_pull(self, task_ids: str) -> Any:
        return None

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def vertex_spec(parity_spec: PipelineSpec) -> PipelineSpec:
    return with_overrides(
        parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": compute()}}), {}
    )


def deferred(op: Any, context: dict[str, Any]) -> Any:
    from airflow.sdk.exceptions import TaskDeferred

    with pytest.raises(TaskDeferred) as info:
        op.execute(context)
    return info.value


def test_execute_defers_and_execute_complete_returns_the_same_xcom(standin: VertexStandIn, parity_spec) -> None:
    spec = vertex_spec(parity_spec)
    op = OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json"))
    ti = FakeTI()
    context: dict[str, Any] = {"params": {}, "run_id": "run-d", "ti": ti}

    defer = deferred(op, context)
    trigger = defer.trigger
    assert isinstance(trigger, VertexJobTrigger) and defer.method_name == "execute_complete"
    assert trigger.endpoint == standin.url and trigger.job_name.endswith("/customJobs/1001")
    assert ti.pushed[WorkloadLink().xcom_key].endswith("/training/1001/cpu?project=loraflow-local")

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    event = asyncio.run(first())
    xcom = op.execute_complete(context, event, **defer.kwargs)
    manifest = artifacts.read_manifest(xcom["manifest"])
    assert xcom == {"stage": "validate_data", "manifest": manifest.uri, "cached": False, "summary": manifest.summary}
    assert manifest.prefix.endswith("/run-d/validate_data") and xcom["summary"]["train_rows"] == 2000
    # lineage: the sources in, the committed prefix out; and a link to that prefix's manifest
    assert {a.uri for a in op.inlets} >= {spec.data.train, spec.data.eval}
    assert [a.uri for a in op.outlets] == [manifest.prefix]
    assert "_MANIFEST.json" in ti.pushed[ArtifactsLink().xcom_key]

    # the cache was filled as on the non-deferred path: the next run submits nothing, nor defers
    again = OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json"))
    hit = again.execute({"params": {}, "run_id": "run-e", "ti": FakeTI()})
    assert hit["cached"] is True and hit["manifest"] == manifest.uri and standin.creates == 1


def test_a_retried_task_reattaches_to_its_job(standin: VertexStandIn, parity_spec) -> None:
    spec = vertex_spec(parity_spec)
    first = deferred(OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json")), _ctx("run-r"))
    retry = deferred(OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json")), _ctx("run-r"))
    assert retry.trigger.job_name == first.trigger.job_name and standin.creates == 1


def _ctx(run_id: str) -> dict[str, Any]:
    return {"params": {}, "run_id": run_id, "ti": FakeTI()}


def test_execute_complete_raises_the_jobs_own_error_and_says_whose_it_is(parity_spec) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    spec = with_overrides(
        parity_spec.model_copy(
            update={"compute": {"validate_data": compute().model_copy(update={"tpu_topology": None})}}
        ),
        {},
    )
    op = OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json"))
    job = "projects/acme-ml/locations/us-central1/customJobs/77"
    kwargs = {"job_name": job, "prefix": "gs://b/p/run/validate_data", "cache_key": "k"}
    failed = {"status": "failed", "state": "JOB_STATE_FAILED", "code": 3}
    replica = "The replica workerpool0-0 exited with a non-zero status of 1. Termination reason: Error."
    with pytest.raises(StepError, match=f"{job} for stage validate_data ended JOB_STATE_FAILED: {replica}$"):
        op.execute_complete(_ctx("run"), failed | {"message": replica}, **kwargs)
    quota = failed | {"code": 8, "message": "Quota exceeded for custom_model_training_cpus"}
    with pytest.raises(AirflowFailException, match=r"\[quota exhausted\].*compute\.validate_data\.region"):
        op.execute_complete(_ctx("run"), quota, **kwargs)
    unwatched = {"status": "error", "state": "", "code": "PERMISSION_DENIED", "message": "polling the job failed: 403"}
    with pytest.raises(AirflowFailException, match=r"could not be watched: polling .*\[permission denied\]"):
        op.execute_complete(_ctx("run"), unwatched, **kwargs)
    pull = failed | {"message": "Unable to pull the container image 'x': not found"}
    with pytest.raises(AirflowFailException, match=r"\[container image not found\].*compute\.validate_data\.image"):
        op.execute_complete(_ctx("run"), pull, **kwargs)


def test_finish_refuses_a_manifest_committed_for_another_cache_key(standin: VertexStandIn, parity_spec) -> None:
    spec = vertex_spec(parity_spec)
    result = runner.run_stage(spec, "validate_data", "run-k", {}, lambda line: None)
    prefix = result.manifest.rsplit("/", 1)[0]
    with pytest.raises(artifacts.ArtifactError, match=r"committed for cache key .* not this attempt's other"):
        runner.finish_stage(spec, "validate_data", prefix, "other")


def test_a_blocking_remote_stage_links_its_job_too(standin: VertexStandIn, parity_spec) -> None:
    """deferrable: false: a worker waits for the job, and the task still gets its 'Remote job' link, as
    soon as the job exists (it is what a person opens while waiting)."""
    blocking = compute().model_copy(update={"deferrable": False})
    spec = parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": blocking}})
    op = OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json"))
    ti = FakeTI()
    xcom = op.execute({"params": {}, "run_id": "run-b", "ti": ti})  # no TaskDeferred: it waited here
    assert ti.pushed[WorkloadLink().xcom_key].endswith("/training/1001/cpu?project=loraflow-local")
    assert artifacts.read_manifest(xcom["manifest"]).prefix.endswith("/run-b/validate_data")
