"""The Vertex AI launcher through the real aiplatform client against the stand-in (tests/vertex_standin.py).

Replicas are local processes: toy programs here, and the real validate_data step against the GCS
emulator end to end through the runner.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loraflow.dev import local_gcs
from loraflow.errors import StepError
from loraflow.launchers.local import KillSwitch
from loraflow.launchers.vertex import VertexLauncher
from loraflow.launchers.vertex_job import JobIdentity
from loraflow.spec.compute import AnyCompute, compute_from
from tests.vertex_standin import VertexStandIn, endpoint_env, replica_env

REPO = Path(__file__).resolve().parents[2]
IMAGE = "us-docker.pkg.dev/acme-ml/loraflow/control:test"


@pytest.fixture
def standin(
    tmp_path: Path, gcs_emulator: local_gcs.Emulator, monkeypatch: pytest.MonkeyPatch
) -> Iterator[VertexStandIn]:
    yield from serve(tmp_path, gcs_emulator, monkeypatch)


def serve(tmp_path: Path, gcs_emulator: local_gcs.Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[VertexStandIn]:
    """The stand-in running the control env's Python as IMAGE, with loraflow pointed at it (also test_triggers)."""
    host_env = replica_env(REPO, gcs_emulator.env())
    with VertexStandIn({IMAGE: sys.executable}, tmp_path / "vertex", host_env, state_delay=0.1) as server:
        for key, value in endpoint_env(server, 0.1).items():
            monkeypatch.setenv(key, value)
        yield server


def compute(hosts: int = 1) -> AnyCompute:
    return compute_from(launcher="vertex", image=IMAGE, machine_type="n2-standard-4", hosts=hosts, region="us-central1")


def launcher(run_id: str = "run-1", hosts: int = 1) -> VertexLauncher:
    identity = JobIdentity("toy-dag", run_id, "toy", "cachekey")
    return VertexLauncher(compute(hosts), identity, "gs://loraflow-test/toy/run-1/toy")


def toy(code: str) -> list[str]:
    return ["python", "-c", code]


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def wait_for(predicate: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_each_replica_gets_its_multihost_wiring(standin: VertexStandIn, tmp_path: Path) -> None:
    out = tmp_path / "wiring"
    out.mkdir()
    code = (
        "import json, os\n"
        "from loraflow.launchers.multihost import distributed_config\n"
        "c = distributed_config()\n"
        f"open(os.path.join({str(out)!r}, str(c.process_id)), 'w').write(json.dumps(c.__dict__))\n"
    )
    log: list[str] = []
    launcher(hosts=2).run(toy(code), log.append)
    configs = [json.loads(p.read_text()) for p in sorted(out.iterdir())]
    assert [c["process_id"] for c in configs] == [0, 1]
    assert {c["num_processes"] for c in configs} == {2} and {c["source"] for c in configs} == {"vertex"}
    assert len({c["coordinator"] for c in configs}) == 1 and configs[0]["coordinator"].startswith("127.0.0.1:")
    states = [line.rsplit(": ", 1)[1] for line in log if ": JOB_STATE_" in line]
    assert states[-1] == "JOB_STATE_SUCCEEDED"
    (job_id,) = standin.states
    assert standin.states[job_id] == [
        "JOB_STATE_QUEUED",
        "JOB_STATE_PENDING",
        "JOB_STATE_RUNNING",
        "JOB_STATE_SUCCEEDED",
    ]
    assert any("submitted Vertex AI CustomJob loraflow.toy-dag.toy." in line for line in log)


def test_a_failing_job_raises_with_the_jobs_own_error(standin: VertexStandIn) -> None:
    code = "import sys; print('ERROR: the dataset is empty', file=sys.stderr); sys.exit(3)"
    with pytest.raises(StepError, match=r"ended JOB_STATE_FAILED: The replica workerpool0-0 exited.*status of 3"):
        launcher().run(toy(code), lambda line: None)
    (job_id,) = standin.states
    assert "the dataset is empty" in standin.job(job_id)["error"]["message"]


def test_an_image_vertex_cannot_pull_fails_the_job(standin: VertexStandIn) -> None:
    bad = VertexLauncher(
        compute().model_copy(update={"image": "us-docker.pkg.dev/acme-ml/loraflow/nope:1"}),
        JobIdentity("toy-dag", "run-1", "toy", "k"),
        "gs://b/p",
    )
    with pytest.raises(StepError, match="Unable to pull the container image"):
        bad.run(toy("pass"), lambda line: None)


def test_a_retry_reattaches_instead_of_resubmitting(standin: VertexStandIn, tmp_path: Path) -> None:
    release = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)\nprint('done')"
    first_log: list[str] = []
    first, first_errors = in_thread(lambda: launcher().run(toy(code), first_log.append))
    wait_for(lambda: any("JOB_STATE_RUNNING" in line for line in first_log), "the first attempt to run")
    # The worker running the first attempt is lost; Airflow retries the task: a new launcher, same identity.
    retry_log: list[str] = []
    retry, retry_errors = in_thread(lambda: launcher().run(toy(code), retry_log.append))
    wait_for(lambda: any("reattaching" in line for line in retry_log), "the retry to reattach")
    release.write_text("go")
    first.join(60)
    retry.join(60)
    assert not first_errors and not retry_errors
    assert standin.creates == 1
    assert any("JOB_STATE_SUCCEEDED" in line for line in retry_log)
    # A restart after the job finished reattaches to the succeeded job: nothing is run again.
    late_log: list[str] = []
    launcher().run(toy(code), late_log.append)
    assert standin.creates == 1 and any("reattaching" in line and "SUCCEEDED" in line for line in late_log)
    # Another run of the same DAG is another job.
    launcher(run_id="run-2").run(toy("pass"), lambda line: None)
    assert standin.creates == 2


def test_a_retry_after_a_failed_attempt_submits_a_new_job(standin: VertexStandIn, tmp_path: Path) -> None:
    marker = tmp_path / "tried"
    code = (
        f"import os, sys\nif not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close(); sys.exit(1)"
    )
    with pytest.raises(StepError):
        launcher().run(toy(code), lambda line: None)
    log: list[str] = []
    launcher().run(toy(code), log.append)
    assert standin.creates == 2
    assert any("ended JOB_STATE_FAILED; submitting a new job" in line for line in log)


def test_kill_cancels_the_running_job_and_its_replicas(standin: VertexStandIn, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    code = f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\ntime.sleep(600)"
    running = launcher(hosts=2)
    log: list[str] = []
    thread, errors = in_thread(lambda: running.run(toy(code), log.append))
    wait_for(lambda: len(list(pids.iterdir())) == 2, "both replicas to start")
    # The operator holds a KillSwitch; the runner arms it with the remote launcher: kill() reaches the job.
    switch = KillSwitch()
    switch.arm(running)
    switch.kill()
    thread.join(60)
    assert errors and isinstance(errors[0], StepError) and "was cancelled" in str(errors[0])
    (job_id,) = standin.states
    assert standin.states[job_id][-2:] == ["JOB_STATE_CANCELLING", "JOB_STATE_CANCELLED"]
    for pid in (int(p.name) for p in pids.iterdir()):
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), f"replica {pid} to end")


def test_a_paused_job_stays_running_and_its_cancel_still_ends_its_replicas(
    standin: VertexStandIn, tmp_path: Path
) -> None:
    """The stand-in's ``pause``: its replicas stop (SIGSTOP), the job stays RUNNING; a cancel ends them at once
    (they take their SIGTERM), not after the stand-in's 10 s wait for a SIGKILL."""
    pids = tmp_path / "pids"
    pids.mkdir()
    code = f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\ntime.sleep(600)"
    running = launcher()
    thread, errors = in_thread(lambda: running.run(toy(code), lambda _: None))
    wait_for(lambda: len(list(pids.iterdir())) == 1, "the replica to start")
    (job_id,) = standin.states
    standin.pause(job_id)
    (pid,) = (int(p.name) for p in pids.iterdir())
    wait_for(lambda: _state(pid) == "T", "the replica to stop")
    time.sleep(1)
    assert standin.job(job_id)["state"] == "JOB_STATE_RUNNING"
    started = time.monotonic()
    running.kill()
    thread.join(60)
    assert errors and "was cancelled" in str(errors[0])
    assert standin.states[job_id][-2:] == ["JOB_STATE_CANCELLING", "JOB_STATE_CANCELLED"]
    assert time.monotonic() - started < 8, "the paused replica waited for the SIGKILL"
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), f"replica {pid} to end")


def test_kill_before_the_job_runs_cancels_it(standin: VertexStandIn) -> None:
    queued = launcher()
    log: list[str] = []
    thread, errors = in_thread(lambda: queued.run(toy("import time; time.sleep(600)"), log.append))
    wait_for(lambda: queued.job_name is not None, "the job to be submitted")
    queued.kill()
    thread.join(60)
    assert errors and "was cancelled" in str(errors[0])
    (job_id,) = standin.states
    assert standin.states[job_id][-1] == "JOB_STATE_CANCELLED"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_validate_data_runs_on_vertex_end_to_end(standin: VertexStandIn, parity_spec) -> None:
    """The runner sends validate_data to the stand-in; its replica runs the real step against the GCS emulator."""
    from loraflow.pipeline import runner
    from loraflow.spec.schema import with_overrides
    from loraflow.storage import artifacts

    spec = with_overrides(
        parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": compute()}}), {}
    )
    assert spec.compute_for("validate_data").launcher == "vertex"

    log: list[str] = []
    result = runner.run_stage(spec, "validate_data", "run-v", {}, log.append, KillSwitch())
    assert not result.cached and result.summary["train_rows"] == 2000
    assert artifacts.read_manifest(result.manifest).prefix.endswith("/run-v/validate_data")
    assert any("launching loraflow.steps.validate_data on Vertex AI" in line for line in log)
    assert any(line.endswith("JOB_STATE_SUCCEEDED") for line in log)
    (job_id,) = standin.states
    job = standin.job(job_id)
    (pool,) = job["jobSpec"]["workerPoolSpecs"]
    assert pool["containerSpec"]["args"][:2] == ["-m", "loraflow.steps.validate_data"]
    assert job["labels"]["loraflow-dag"] == spec.name
    # The next run's identical stage is a cache hit: nothing is submitted.
    again = runner.run_stage(spec, "validate_data", "run-w", {}, lambda line: None)
    assert again.cached and standin.creates == 1
