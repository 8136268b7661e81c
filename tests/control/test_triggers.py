"""The deferrable path's trigger: pinned serialization, polling the stand-in asynchronously, and
cancellation only on a user's action (Airflow's own TriggerRunner decides which), never on a restart."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev import local_gcs
from loraflow.launchers.vertex import endpoint_for
from operators.triggers import VertexJobTrigger
from tests.control.test_vertex_launcher import compute, launcher, serve, toy, wait_for
from tests.vertex_standin import VertexStandIn


@pytest.fixture
def standin(
    tmp_path: Path, gcs_emulator: local_gcs.Emulator, monkeypatch: pytest.MonkeyPatch
) -> Iterator[VertexStandIn]:
    yield from serve(tmp_path, gcs_emulator, monkeypatch)


NAME = "projects/loraflow-local/locations/us-central1/customJobs/1001"


def test_serialize_is_pinned_and_round_trips() -> None:
    trigger = VertexJobTrigger(job_name=NAME, endpoint="http://127.0.0.1:1", stage="lora_sft", poll_seconds=5)
    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.triggers.vertex.VertexJobTrigger"
    assert kwargs == {"job_name": NAME, "endpoint": "http://127.0.0.1:1", "stage": "lora_sft", "poll_seconds": 5.0}
    # What the task runner stores (Airflow's serde) and what the triggerer re-creates from it, under the
    # path this version writes and the one an earlier version wrote into a triggerer's database.
    from airflow.sdk._shared.module_loading import import_string
    from airflow.sdk.serde import deserialize, serialize

    stored = deserialize(serialize(kwargs))
    for path in (classpath, "operators.triggers.VertexJobTrigger"):
        again = import_string(path)(**stored)
        assert again.serialize() == (classpath, kwargs)


def _submit(code: str) -> str:
    job = launcher().submit(toy(code), lambda line: None)
    return str(job.name)


def _trigger(name: str) -> VertexJobTrigger:
    return VertexJobTrigger(job_name=name, endpoint=endpoint_for(compute()), stage="toy", poll_seconds=0.1)


async def _first_event(trigger: VertexJobTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


def test_a_succeeding_job_fires_success(standin: VertexStandIn) -> None:
    name = _submit("print('hello')")
    event = asyncio.run(_first_event(_trigger(name)))
    assert event == {
        "job_name": name,
        "stage": "toy",
        "status": "success",
        "state": "JOB_STATE_SUCCEEDED",
        "code": None,
        "message": "",
    }


def test_a_failing_job_fires_its_own_error(standin: VertexStandIn) -> None:
    name = _submit("import sys; print('ValueError: no rows', file=sys.stderr); sys.exit(2)")
    event = asyncio.run(_first_event(_trigger(name)))
    assert event["status"] == "failed" and event["state"] == "JOB_STATE_FAILED"
    assert "exited with a non-zero status of 2" in event["message"] and "no rows" in event["message"]


def test_transient_poll_errors_are_retried(standin: VertexStandIn) -> None:
    name = _submit("print('hello')")
    standin.faults = [(503, "UNAVAILABLE"), (500, "INTERNAL"), (429, "RESOURCE_EXHAUSTED")]
    event = asyncio.run(_first_event(_trigger(name)))
    assert event["status"] == "success" and standin.faults == []


def test_a_permission_error_ends_the_wait_at_once(standin: VertexStandIn) -> None:
    name = _submit("print('hello')")
    standin.faults = [(403, "PERMISSION_DENIED")]
    event = asyncio.run(_first_event(_trigger(name)))
    assert event["status"] == "error" and event["code"] == "PERMISSION_DENIED"
    assert "PERMISSION_DENIED" in event["message"]


def _job_id(name: str) -> str:
    return name.rsplit("/", 1)[1]


async def _through_airflows_trigger_runner(trigger: VertexJobTrigger, how: str) -> None:
    """Run the trigger as the triggerer does, then stop it: ``user`` (mark failed / clear) or ``restart``."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner

    runner = TriggerRunner()
    task = asyncio.create_task(runner.run_trigger(1, trigger))
    runner.triggers[1] = {"task": task, "name": "vertex", "events": 0, "is_watcher": False}  # type: ignore[typeddict-item]
    await asyncio.sleep(1.0)  # polling
    assert not task.done()
    if how == "user":
        runner.to_cancel.append(1)
        await runner.cancel_triggers()
    else:
        task.cancel()  # what a triggerer shutdown does to its triggers
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture(autouse=True)
def _no_greenback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_DISABLE_GREENBACK_PORTAL", "true")


def test_a_user_action_on_the_deferred_task_cancels_the_job(standin: VertexStandIn) -> None:
    name = _submit("import time; time.sleep(600)")
    wait_for(lambda: standin.job(_job_id(name))["state"] == "JOB_STATE_RUNNING", "the job to run")
    asyncio.run(_through_airflows_trigger_runner(_trigger(name), "user"))
    wait_for(lambda: standin.job(_job_id(name))["state"] == "JOB_STATE_CANCELLED", "the job to be cancelled")


def test_a_triggerer_restart_leaves_the_job_running_and_a_new_trigger_resumes(
    standin: VertexStandIn, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    name = _submit(f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)")
    wait_for(lambda: standin.job(_job_id(name))["state"] == "JOB_STATE_RUNNING", "the job to run")
    trigger = _trigger(name)
    asyncio.run(_through_airflows_trigger_runner(trigger, "restart"))
    assert standin.job(_job_id(name))["state"] == "JOB_STATE_RUNNING"
    assert "JOB_STATE_CANCELLING" not in standin.states[_job_id(name)]
    # The next triggerer re-creates the trigger from what was stored and picks the job up again.
    _, kwargs = trigger.serialize()
    resumed = VertexJobTrigger(**kwargs)
    release.write_text("go")
    event = asyncio.run(_first_event(resumed))
    assert event["status"] == "success" and standin.creates == 1
    assert os.environ["LORAFLOW_VERTEX_ENDPOINT"] == standin.url == kwargs["endpoint"]
