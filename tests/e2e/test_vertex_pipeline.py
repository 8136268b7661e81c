"""The tiny pipeline with lora_sft on "Vertex AI" (the stand-in, tests/vertex_standin.py), deferred, on a
real local Airflow with a triggerer: the stack the end-to-end modules share (tests/e2e/conftest.py, which
names the stand-in's endpoint to it as it starts), the spec with test_tiny_pipeline.py's artifact root: run
after that module (CACHE_FROM), its runs take validate_data, convert_checkpoint and evaluate_base from the
cache (its lora_sft runs on the stand-in, never from the cache: asserted). Two runs:

- ``ok``: the whole pipeline succeeds; lora_sft submits its CustomJob and waits in the triggerer. While
  it waits the stand-in answers one poll with PERMISSION_DENIED: the try fails saying so, the task is
  retried (by the spec's retry policy, or cleared), and the new try reattaches to the job still running
  instead of submitting another.
- ``cancel``: a long lora_sft job (its replica paused once running: the job stays RUNNING, training nothing);
  the triggerer restarts while the task is deferred (the job keeps running), then the task is marked failed
  from the REST API and the stand-in's job is cancelled.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev.demo import LocalAirflow, prepare
from loraflow.dev.shared_stack import SharedStack
from loraflow.launchers.environments import ENVIRONMENTS
from loraflow.spec.schema import load_spec
from loraflow.storage import artifacts, gcs
from tests.vertex_standin import VertexStandIn, endpoint_env, replica_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
DAG = "tiny-vertex"
# The module whose runs (before this one's) leave the local stages these runs share with them in the cache.
CACHE_FROM = "test_tiny_pipeline"  # its __name__, as it names itself to the stack
TRAINER_IMAGE = "us-docker.pkg.dev/loraflow-local/loraflow/trainer:e2e"
VERTEX_LORA_SFT = f"""
  lora_sft:
    launcher: vertex
    image: {TRAINER_IMAGE}
    machine_type: n2-standard-4
    region: us-central1
"""


def vertex_spec(folder: Path) -> Path:
    """The tiny spec, renamed, with lora_sft on Vertex AI (deferrable is the default)."""
    text = TINY.read_text().replace("name: tiny-llama-lora", f"name: {DAG}")
    text = text.replace(
        "compute:\n  default:\n    launcher: local\n", "compute:\n  default:\n    launcher: local" + VERTEX_LORA_SFT
    )
    assert TRAINER_IMAGE in text
    path = folder / f"{DAG}.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert spec.compute_for("lora_sft").launcher == "vertex" and spec.artifact_root == load_spec(TINY).artifact_root
    return path


def until(predicate: Callable[[], Any], what: str, seconds: float = 600, every: float = 1.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def ti(airflow: LocalAirflow, run_id: str, task: str) -> dict[str, Any]:
    _, body = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task}")
    return body if isinstance(body, dict) else {}


def jobs_of(standin: VertexStandIn, stage: str) -> list[dict[str, Any]]:
    return [standin.job(i) for i in list(standin.states) if standin.job(i)["labels"]["loraflow-stage"] == stage]


class Stack:
    def __init__(self, airflow: LocalAirflow, standin: VertexStandIn) -> None:
        self.airflow, self.standin = airflow, standin
        self.results: dict[str, Any] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, shared_stack: SharedStack, shared_stack_vertex_port: int):
    home = tmp_path_factory.mktemp("vstack")
    spec_path = vertex_spec(home)
    host_env = replica_env(REPO)
    images = {TRAINER_IMAGE: str(ENVIRONMENTS["trainer"].local_python())}
    with VertexStandIn(images, home / "vertex", host_env, state_delay=0.5, port=shared_stack_vertex_port) as standin:
        airflow = shared_stack.use(__name__, spec_path, cache_from=CACHE_FROM)
        # Airflow's components (workers, triggerer) took these as they started: the launcher and trigger talk to
        # the stand-in.
        assert {k: airflow.env[k] for k in endpoint_env(standin, 2)} == endpoint_env(standin, 2)
        standin.host_env |= {
            k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT") if k in os.environ
        }
        prepare(spec_path, home)
        airflow.wait_for_dag(DAG)
        s = Stack(airflow, standin)
        run_ok(s)
        run_cancel(s)
        s.results["ok_state"] = airflow.wait_for_run(DAG, s.results["ok"], timeout=900)
        yield s


def run_ok(s: Stack) -> None:
    a, r = s.airflow, s.results
    r["ok"] = run = a.trigger(DAG, {"training_steps": 10, "gate_min_improvement": -1})
    until(lambda: ti(a, run, "lora_sft").get("state") == "deferred", "lora_sft to defer")
    (job,) = jobs_of(s.standin, "lora_sft")
    r["ok_job"] = job["name"]
    r["deferred_while"] = job["state"]
    # The next poll is refused: the try fails with the permission problem spelled out.
    s.standin.faults.append((403, "PERMISSION_DENIED"))
    # The try fails; the spec's retry policy runs it again, or (no retries left) a person clears it.
    until(
        lambda: ti(a, run, "lora_sft").get("try_number", 1) >= 2 or ti(a, run, "lora_sft").get("state") == "failed",
        "the try to fail",
        seconds=300,
    )
    r["failed_log"] = a.task_log(DAG, run, "lora_sft", 1)
    r["job_state_after_failure"] = s.standin.job(job["name"].rsplit("/", 1)[1])["state"]
    if ti(a, run, "lora_sft").get("state") == "failed":
        # Clear only once the scheduler has settled the run (clearing mid-update races it on SQLite).
        until(lambda: a.call("GET", f"/dags/{DAG}/dagRuns/{run}")[1].get("state") == "failed", "the run to fail")
        body = {
            "dry_run": False,
            "task_ids": ["lora_sft"],
            "dag_run_id": run,
            "include_downstream": True,
            "only_failed": False,
            "reset_dag_runs": True,
        }
        status, answer = a.call("POST", f"/dags/{DAG}/clearTaskInstances", body)
        assert status == 200, answer
    until(lambda: ti(a, run, "lora_sft").get("state") == "success", "the retried lora_sft to succeed")
    r["retry_log"] = a.task_log(DAG, run, "lora_sft", 2)
    r["ok_ti"] = ti(a, run, "lora_sft")


def run_cancel(s: Stack) -> None:
    a, r = s.airflow, s.results
    r["cancel"] = run = a.trigger(DAG, {"training_steps": 2000})
    until(lambda: ti(a, run, "lora_sft").get("state") == "deferred", "the long lora_sft to defer")
    (job,) = [j for j in jobs_of(s.standin, "lora_sft") if j["name"] != r["ok_job"]]
    job_id = job["name"].rsplit("/", 1)[1]
    until(lambda: s.standin.job(job_id)["state"] == "JOB_STATE_RUNNING", "the job to run", seconds=60)
    # Its replica only has to stay running (it would train 2,000 steps for nothing, on a core the machine's
    # other work needs): paused, the job is RUNNING until it is cancelled.
    s.standin.pause(job_id)
    a.restart("triggerer")
    polls = s.standin.requests.count(("GET", f"/v1/{job['name']}"))
    # The new triggerer takes the trigger over (once the old one's heartbeat is stale) and polls the job.
    until(
        lambda: s.standin.requests.count(("GET", f"/v1/{job['name']}")) > polls + 1,
        "the new triggerer to poll the job",
        seconds=180,
    )
    r["after_restart"] = (
        s.standin.job(job_id)["state"],
        list(s.standin.states[job_id]),
        ti(a, run, "lora_sft")["state"],
    )
    status, body = a.call("PATCH", f"/dags/{DAG}/dagRuns/{run}/taskInstances/lora_sft", {"new_state": "failed"})
    assert status == 200, body
    r["cancelled"] = until(
        lambda: s.standin.job(job_id)["state"] == "JOB_STATE_CANCELLED" and list(s.standin.states[job_id]),
        "the stand-in job to be cancelled",
        seconds=120,
    )


def test_the_pipeline_succeeds_with_lora_sft_on_vertex(stack: Stack) -> None:
    r = stack.results
    assert r["ok_state"] == "success"
    xcom = stack.airflow.xcom(DAG, r["ok"], "lora_sft")
    run_prefix = gcs.join(load_spec(TINY).artifact_root, DAG, artifacts.safe_run_id(r["ok"]))
    manifest = artifacts.read_manifest(xcom["manifest"])
    assert manifest.prefix == f"{run_prefix}/lora_sft" and xcom["cached"] is False
    assert xcom["summary"] == manifest.summary and manifest.summary  # the same XCom as a local run
    # the job ran the real lora_sft step in the trainer "image"
    (job,) = jobs_of(stack.standin, "lora_sft")[:1]
    assert job["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"][:2] == ["-m", "loraflow.steps.lora_sft"]
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    # the trained adapter fed the rest of the pipeline
    for task in ("merge_adapter", "evaluate_tuned", "gate", "report"):
        assert stack.airflow.task_states(DAG, r["ok"])[task] == "success", task


def test_the_deferred_task_freed_its_worker_and_links_to_the_job(stack: Stack) -> None:
    r = stack.results
    assert r["deferred_while"] in {"JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING"}
    assert "deferring: the triggerer polls" in r["retry_log"] or "deferring" in r["failed_log"]
    status, links = stack.airflow.call("GET", f"/dags/{DAG}/dagRuns/{r['ok']}/taskInstances/lora_sft/links")
    assert status == 200, links
    job_id = r["ok_job"].rsplit("/", 1)[1]
    text = json.dumps(links)
    assert f"/vertex-ai/locations/us-central1/training/{job_id}/cpu?project=loraflow-local" in text
    assert "lora_sft%2F_MANIFEST.json" in text  # the Artifacts link: the committed manifest


def test_a_poll_permission_error_says_so_and_the_retry_reattaches(stack: Stack) -> None:
    r = stack.results
    assert "permission denied" in r["failed_log"] and "roles/aiplatform.user" in r["failed_log"]
    assert r["job_state_after_failure"] != "JOB_STATE_CANCELLED"  # a failed try leaves the job alone
    assert "reattaching to " + r["ok_job"] in r["retry_log"]
    assert r["ok_ti"]["try_number"] == 2
    assert len(jobs_of(stack.standin, "lora_sft")) == 2  # the ok run's one job + the cancel run's one


def test_a_triggerer_restart_does_not_cancel_but_marking_failed_does(stack: Stack) -> None:
    r = stack.results
    state, states, ti_state = r["after_restart"]
    assert state == "JOB_STATE_RUNNING" and "JOB_STATE_CANCELLING" not in states and ti_state == "deferred"
    assert r["cancelled"][-2:] == ["JOB_STATE_CANCELLING", "JOB_STATE_CANCELLED"]
    assert stack.airflow.task_states(DAG, r["cancel"])["lora_sft"] == "failed"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
