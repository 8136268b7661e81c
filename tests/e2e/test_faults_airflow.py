"""One real Airflow run of the tiny pipeline in which every stage's step program is SIGKILLed once, at
its own kill point, and Airflow's retries (from the spec's ``retry`` section) finish the run. The
same run carries a planted secret (an HF token in an Airflow connection) that every output is
searched for. On the stack the end-to-end modules share (tests/e2e/conftest.py), which took the kills
(of this pipeline's steps only) and the connection as it started (``PlantedFaults``), the spec with an
artifact root of its own. Takes several minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev.demo import LocalAirflow, prepare, verdict
from loraflow.dev.shared_stack import SharedStack
from loraflow.launchers import credentials
from loraflow.spec.schema import STAGES, load_spec
from loraflow.storage import artifacts, gcs
from tests.planted_faults import PlantedFaults

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
ARTIFACT_ROOT = "gs://loraflow-demo/faults-artifacts"  # its own in the shared stack: no stage from another's cache


def faults_spec(folder: Path, planted: PlantedFaults) -> Path:
    """The tiny pipeline with short retry delays and an HF token taken from an Airflow connection."""
    text = TINY.read_text().replace("name: tiny-llama-lora", f"name: {planted.dag}")
    text = text.replace("artifact_root: gs://loraflow-demo/artifacts", f"artifact_root: {ARTIFACT_ROOT}")
    text += (
        "\nretry:\n  retries: 2\n  delay_seconds: 2\n  backoff: 2\n  max_delay_seconds: 10\n"
        f"\nsecrets:\n  HF_TOKEN:\n    connection: {planted.connection}\n"
    )
    path = folder / f"{planted.dag}.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert (spec.name, spec.artifact_root) == (planted.dag, ARTIFACT_ROOT)
    return path


class Outcome:
    def __init__(
        self, airflow: LocalAirflow, dag: str, run_id: str, state: str, token: str, spec_path: Path, faults: Path
    ):
        self.airflow, self.dag, self.run_id, self.state, self.token = airflow, dag, run_id, state, token
        self.spec_path, self.faults = spec_path, faults
        self.planted: dict[str, str] = {}  # the environment the stack ran with (the fault, the connection)
        self.kills: dict[str, str] = {}  # stage -> the point its step was killed at
        self.tis: dict[str, dict[str, Any]] = {}
        self.logs: dict[tuple[str, int], str] = {}
        self.xcoms: dict[str, Any] = {}
        self.verdict: dict[str, Any] = {}

    def log(self, task: str, try_number: int) -> str:
        return self.logs[(task, try_number)]

    def killed_try(self, task: str) -> int:
        """The one try of ``task`` the injected fault killed. Normally try 1; on an overloaded machine
        Airflow can lose a try before the step program starts (the task's start call to the API server
        times out); such a try launched nothing, so it computed nothing either."""
        tries = range(1, self.tis[task]["try_number"] + 1)
        killed = [n for n in tries if "[fault] injected SIGKILL" in self.log(task, n)]
        assert len(killed) == 1, f"{task}: killed in tries {killed}"
        for n in tries:
            if n < killed[0]:
                assert "launching loraflow.steps" not in self.log(task, n), f"{task} try {n} ran its step"
        return killed[0]

    def raw_log(self, task: str, try_number: int) -> str:
        """The task log file as Airflow wrote it (with the exception's text, which the REST log omits)."""
        folder = self.airflow.home / "logs" / f"dag_id={self.dag}" / f"run_id={self.run_id}" / f"task_id={task}"
        return (folder / f"attempt={try_number}.log").read_text()


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory, shared_stack: SharedStack, planted_faults: PlantedFaults):
    home = tmp_path_factory.mktemp("faults")
    spec_path = faults_spec(home, planted_faults)
    # the stack's processes (so every task and step program) took the kills and the connection; this process not
    airflow = shared_stack.use(__name__, spec_path)
    name = planted_faults.dag
    spec = prepare(spec_path, home)
    airflow.wait_for_dag(name)
    run_id = airflow.trigger(name)
    state = airflow.wait_for_run(name, run_id, timeout=1500)
    result = Outcome(airflow, name, run_id, state, planted_faults.token, spec_path, planted_faults.state)
    result.planted = planted_faults.env
    _, body = airflow.call("GET", f"/dags/{name}/dagRuns/{run_id}/taskInstances")
    result.tis = {ti["task_id"]: ti for ti in body["task_instances"]}
    for task, ti in result.tis.items():
        for n in range(1, (ti.get("try_number") or 1) + 1):
            result.logs[(task, n)] = airflow.task_log(name, run_id, task, n)
        result.xcoms[task] = airflow.xcom(name, run_id, task)
    result.verdict = verdict(spec, airflow, run_id)
    result.kills = planted_faults.kills
    return result


def test_every_stage_was_killed_once_and_its_retry_completed_the_run(outcome: Outcome) -> None:
    assert outcome.state == "success", {t: ti["state"] for t, ti in outcome.tis.items()}
    assert set(outcome.tis) == set(STAGES)
    for stage, point in outcome.kills.items():
        ti = outcome.tis[stage]
        assert ti["state"] == "success", stage
        killed = outcome.killed_try(stage)
        at = f"{outcome.dag}/{stage}:{point.split('@')[0]}"
        assert f"[fault] injected SIGKILL at {at}" in outcome.log(stage, killed), stage
        assert "killed by signal 9" in outcome.raw_log(stage, killed), stage
        assert ti["try_number"] == killed + 1, f"{stage}: the try after the kill should have completed it"
        assert "[fault]" not in outcome.log(stage, killed + 1), stage
        assert (outcome.faults / f"{outcome.dag}.{stage}.{point.split('@')[0]}").is_file()
    assert outcome.verdict["decision"]["promote"] is True


def test_lora_sft_retry_resumed_from_its_last_complete_checkpoint(outcome: Outcome) -> None:
    killed = outcome.killed_try("lora_sft")
    first, second = outcome.log("lora_sft", killed), outcome.log("lora_sft", killed + 1)
    assert "checkpoint step 50 persisted" in first and "checkpoint step 100 persisted" not in first
    # Step 100's files were uploaded without their completion marker: the retry ignores them.
    assert "found checkpoint step 50 under" in second and "resuming at step 50" in second
    trained = [int(m) for m in re.findall(r"step (\d+)/200 loss", second)]
    assert trained and min(trained) > 50, "the retry retrained steps that were already checkpointed"
    assert "checkpoint step 50 persisted" not in second
    summary = outcome.xcoms["lora_sft"]["summary"]
    assert summary["resumed_from_step"] == 50


def test_no_committed_step_was_recomputed(outcome: Outcome) -> None:
    # Each task ran its step program exactly twice (the killed try, the retry); nothing upstream ran again.
    for task, ti in outcome.tis.items():
        assert ti["try_number"] == outcome.killed_try(task) + 1, task
    assert not any(x["cached"] for x in outcome.xcoms.values() if x)
    # publish's retry found nothing registered (it died before its manifest, after registering): the
    # registry holds the run's model once.
    spec = load_spec(outcome.spec_path)
    bucket, path = gcs.split_uri(f"{spec.registry_uri}/{outcome.dag}/versions/")
    versions = [b.name for b in gcs.client().list_blobs(bucket, prefix=path)]
    assert len(versions) == 1, versions
    assert "already registered" in outcome.log("publish", 2)


def test_every_manifest_verifies_and_no_stray_file_is_left(outcome: Outcome, tmp_path: Path) -> None:
    spec = load_spec(outcome.spec_path)
    run_prefix = gcs.join(spec.artifact_root, outcome.dag, artifacts.safe_run_id(outcome.run_id))
    listed: set[str] = set()
    for stage in STAGES:
        manifest = artifacts.read_manifest(outcome.xcoms[stage]["manifest"])
        assert manifest.prefix == f"{run_prefix}/{stage}"
        artifacts.fetch(manifest, tmp_path / stage)  # every file present, every checksum right
        listed |= {f"{manifest.prefix}/{name}" for name in manifest.files} | {manifest.uri}
    bucket, path = gcs.split_uri(run_prefix)
    stored = {f"gs://{bucket}/{b.name}" for b in gcs.client().list_blobs(bucket, prefix=path + "/")}
    # Files a killed try uploaded under names the retry did not reuse stay outside every manifest:
    # no reader uses them (readers go through manifests). Count them for docs/reliability.md.
    strays = sorted(u for u in stored - listed if "/lora_sft/_checkpoints/" not in u)
    print(f"[faults] {len(stored)} objects under the run, {len(strays)} outside any manifest: {strays[:10]}")
    assert all(not u.endswith(artifacts.MANIFEST) for u in strays)


def test_the_planted_secret_reached_the_steps_and_nothing_else(outcome: Outcome) -> None:
    token = outcome.token
    expected = f"secret HF_TOKEN ({credentials.fingerprint(token)}) passed to the step in its environment"
    for stage in STAGES:
        assert expected in outcome.log(stage, outcome.tis[stage]["try_number"]), f"{stage} got no token"
    # Task logs (every try), XCom, every object in the bucket (artifacts, cache, registry, the
    # report, the rejected-evidence folders), `loraflow plan`, the Airflow component logs.
    for (task, n), text in outcome.logs.items():
        assert token not in text, f"the secret is in the log of {task} try {n}"
    assert token not in json.dumps(outcome.xcoms)
    spec = load_spec(outcome.spec_path)
    bucket, _ = gcs.split_uri(spec.artifact_root)
    blobs = list(gcs.client().list_blobs(bucket))
    assert any(b.name.endswith("report/report.html") for b in blobs)
    for blob in blobs:
        assert token.encode() not in blob.download_as_bytes(), f"the secret is in gs://{bucket}/{blob.name}"
    plan = subprocess.run(  # in the stack's environment: the connection holding the secret is there
        [str(Path(sys.executable).parent / "loraflow"), "plan", str(outcome.spec_path)],
        capture_output=True,
        text=True,
        env={**os.environ, **outcome.planted},
    )
    assert plan.returncode == 0 and "lora_sft" in plan.stdout and token not in plan.stdout + plan.stderr
    for path in (outcome.airflow.home / "logs").rglob("*"):
        if path.is_file():
            assert token not in path.read_text(errors="replace"), f"the secret is in {path}"
