"""A gke stage on the deferrable path, against the Kubernetes stand-in, without a scheduler: execute()
creates the JobSet and defers to GkeJobSetTrigger, whose event resumes execute_complete(); a retry
reattaches, a failure carries the pod's message, a user's action deletes the JobSet."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from loraflow.errors import StepError
from loraflow.spec.schema import PipelineSpec, with_overrides
from loraflow.storage import artifacts
from operators.links import WorkloadLink
from operators.stages import OPERATORS
from operators.triggers import GkeJobSetTrigger
from tests.control.test_gke import COMPLETED, COMPUTE, FAILED, RUNNING, play_the_pod
from tests.control.test_vertex_operator import FakeTI, deferred
from tests.gke_standin import GkeStandIn, serve


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[GkeStandIn]:
    with serve() as server:
        monkeypatch.setenv("LORAFLOW_GKE_ENDPOINT", server.url)
        monkeypatch.setenv("LORAFLOW_GKE_POLL_SECONDS", "0.05")
        yield server


def gke_spec(parity_spec: PipelineSpec) -> PipelineSpec:
    return with_overrides(
        parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": COMPUTE}}), {}
    )


def _op(spec: PipelineSpec) -> Any:
    return OPERATORS["validate_data"].for_spec(spec.model_dump(mode="json"))


def _ctx(run_id: str, ti: FakeTI | None = None) -> dict[str, Any]:
    return {"params": {}, "run_id": run_id, "ti": ti or FakeTI()}


async def _first_event(trigger: GkeJobSetTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


def test_serialize_is_pinned_and_round_trips() -> None:
    trigger = GkeJobSetTrigger(namespace="ml", name="lf-x", stage="lora_sft", poll_seconds=5, endpoint=None)
    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.triggers.gke.GkeJobSetTrigger"
    assert kwargs == {"namespace": "ml", "name": "lf-x", "stage": "lora_sft", "poll_seconds": 5.0, "endpoint": None}
    from airflow.sdk._shared.module_loading import import_string
    from airflow.sdk.serde import deserialize, serialize

    for path in (classpath, "operators.triggers.GkeJobSetTrigger"):  # the path an earlier version stored
        again = import_string(path)(**deserialize(serialize(kwargs)))
        assert again.serialize() == (classpath, kwargs)


def test_execute_defers_and_the_completed_jobset_resumes_to_the_same_xcom(
    standin: GkeStandIn, parity_spec, gcs_emulator
) -> None:
    spec, ti = gke_spec(parity_spec), FakeTI()
    op = _op(spec)
    defer = deferred(op, _ctx("run-g", ti))
    trigger = defer.trigger
    assert isinstance(trigger, GkeJobSetTrigger) and defer.method_name == "execute_complete"
    assert (trigger.namespace, trigger.endpoint) == ("ml", standin.url)
    assert defer.kwargs["job_name"] == f"ml/{trigger.name}"
    assert f"jobset-name%22%3D%22{trigger.name}%22" in ti.pushed[WorkloadLink().xcom_key]  # the pods' logs
    [js] = standin.jobsets.values()

    # A retry of the deferred task (or a worker restart) reattaches instead of creating another JobSet.
    retry = deferred(_op(spec), _ctx("run-g"))
    assert retry.trigger.name == trigger.name and standin.creates() == 1

    play_the_pod(js, gcs_emulator)
    standin.set_status("ml", trigger.name, RUNNING)
    standin.set_status("ml", trigger.name, COMPLETED)
    event = asyncio.run(_first_event(trigger))
    assert event["status"] == "success" and event["state"] == "succeeded"
    xcom = op.execute_complete(_ctx("run-g", ti), event, **defer.kwargs)
    manifest = artifacts.read_manifest(xcom["manifest"])
    assert manifest.prefix.endswith("/run-g/validate_data") and xcom["summary"]["train_rows"] == 2000

    # Once it completed, a cleared task reattaches and finishes at once, without deferring again.
    again = _op(spec).execute(_ctx("run-g"))
    assert again["manifest"] == manifest.uri and standin.creates() == 1


def test_a_failed_jobset_fails_the_task_with_the_pods_message(standin: GkeStandIn, parity_spec) -> None:
    spec = gke_spec(parity_spec)
    op = _op(spec)
    defer = deferred(op, _ctx("run-f"))
    name = defer.trigger.name
    standin.add_pod("ml", name, 0, 2, "[validate_data] ERROR: dataset input has no train.jsonl")
    standin.set_status("ml", name, FAILED)
    event = asyncio.run(_first_event(defer.trigger))
    assert event["status"] == "failed" and "FailedJobs" in event["message"]
    with pytest.raises(StepError, match=r"failed: FailedJobs.*exited with status 2: .*no train\.jsonl"):
        op.execute_complete(_ctx("run-f"), event, **defer.kwargs)


def test_lasting_api_errors_fail_without_retries_and_say_what_to_change(standin: GkeStandIn, parity_spec) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    spec = gke_spec(parity_spec)
    op = _op(spec)
    defer = deferred(op, _ctx("run-e"))
    standin.faults += [503, 403]  # one transient answer (retried), then RBAC says no
    event = asyncio.run(_first_event(defer.trigger))
    assert event["status"] == "error" and event["code"] == 403
    with pytest.raises(AirflowFailException, match=r"403.*jobsets\.jobset\.x-k8s\.io.*namespace ml"):
        op.execute_complete(_ctx("run-e"), event, **defer.kwargs)


def test_a_users_action_deletes_the_jobset_and_a_deleted_one_fails_the_wait(standin: GkeStandIn, parity_spec) -> None:
    defer = deferred(_op(gke_spec(parity_spec)), _ctx("run-k"))
    trigger = defer.trigger
    asyncio.run(trigger.on_kill())
    assert ("ml", trigger.name) not in standin.jobsets
    assert standin.deletions == [{"propagationPolicy": "Foreground"}]
    event = asyncio.run(_first_event(trigger))
    assert event["status"] == "failed" and event["state"] == "deleted"
