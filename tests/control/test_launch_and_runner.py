"""The local launcher (streams, reports failures, kills the whole process group) and the runner's cache."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from loraflow.errors import StepError
from loraflow.launchers.local import LocalLauncher, step_environment
from loraflow.spec.compute import compute_from
from loraflow.storage import artifacts

REPO = Path(__file__).resolve().parents[2]


def test_lines_are_streamed_as_they_come() -> None:
    lines: list[tuple[float, str]] = []
    code = "import time\nfor i in range(3):\n    print('step', i, flush=True); time.sleep(0.3)"
    LocalLauncher().run([sys.executable, "-c", code], lambda line: lines.append((time.monotonic(), line)))
    assert [text for _, text in lines] == ["step 0", "step 1", "step 2"]
    assert lines[-1][0] - lines[0][0] > 0.4  # not buffered until exit


def test_a_failing_step_raises_with_its_last_error_line() -> None:
    code = "import sys; print('working'); print('ERROR: the dataset is empty', file=sys.stderr); sys.exit(2)"
    with pytest.raises(StepError, match=r"exit status 2.*the dataset is empty"):
        LocalLauncher().run([sys.executable, "-c", code], lambda line: None)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that no longer exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_kill_stops_the_step_and_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r} + '.partial', 'w').write(str(child.pid))\n"
        f"import os; os.replace({str(pid_file)!r} + '.partial', {str(pid_file)!r})\n"
        "print('started', flush=True); time.sleep(600)"
    )
    launcher = LocalLauncher()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            launcher.run([sys.executable, "-c", code], lambda line: None)
        except StepError as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), "the step program never started its child"
    child = int(pid_file.read_text())
    launcher.kill()
    thread.join(timeout=30)
    assert errors and "killed by signal" in str(errors[0])
    time.sleep(0.5)
    assert not alive(child)


def test_secrets_of_the_worker_do_not_leak_into_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://user:secret@db/airflow")
    env = step_environment({"EXTRA": "1"})
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in env and env["EXTRA"] == "1"
    assert env["PYTHONPATH"] == str(REPO)


def test_second_run_of_a_stage_is_a_cache_hit(parity_spec) -> None:
    """validate_data through the runner twice: the second time nothing is launched."""
    from loraflow.pipeline import runner

    spec = parity_spec

    first_log: list[str] = []
    first = runner.run_stage(spec, "validate_data", "run-a", {}, first_log.append)
    assert not first.cached and first.summary["train_rows"] == 2000
    assert any("cache miss" in line for line in first_log)
    second_log: list[str] = []
    second = runner.run_stage(spec, "validate_data", "run-b", {}, second_log.append)
    assert second.cached and second.manifest == first.manifest
    assert any("cache hit" in line for line in second_log)
    assert not any("launching" in line for line in second_log)
    assert artifacts.read_manifest(first.manifest).prefix.endswith("/run-a/validate_data")


def test_a_rerun_on_changed_inputs_in_the_same_run_commits_beside_the_first(parity_spec) -> None:
    """A task cleared and re-run with other inputs (or config) keeps the first commit untouched."""
    from loraflow.pipeline import runner
    from loraflow.spec.schema import with_overrides

    first = runner.run_stage(parity_spec, "validate_data", "run-c", {}, lambda _: None)
    before = artifacts.read_manifest(first.manifest).data
    changed = with_overrides(parity_spec, {"data.expectations.row_count.min": 50})
    second = runner.run_stage(changed, "validate_data", "run-c", {}, lambda _: None)
    assert not second.cached and second.manifest != first.manifest
    key = artifacts.read_manifest(second.manifest).data["cache_key"]
    assert artifacts.read_manifest(second.manifest).prefix.endswith(f"/run-c/validate_data-{key[:12]}")
    assert artifacts.read_manifest(first.manifest).data == before
    again = runner.run_stage(changed, "validate_data", "run-c", {}, lambda _: None)
    assert again.manifest == second.manifest  # the same key finds its own commit


# The runner in-process, around a stand-in for the step program: every decision run_stage makes (cache
# key, hit or miss, where the commit lands, which launcher, what it is given) without starting one.


class FakeStep:
    """Stands in for the step program a launcher starts: ``install`` replaces a launcher's ``run`` and
    ``kill`` (everything else is the real launcher's) and records what it was given; like a step that
    ended well, it commits at ``--output`` with the ``--cache-key`` it was handed."""

    def __init__(self, commit_key: str | None = None) -> None:
        self.calls: list[dict] = []
        self.killed = False
        self.commit_key = commit_key  # a step that commits another key than it was given
        self.made: list = []  # (compute, identity, output prefix) of each launcher made

    def install(self, monkeypatch: pytest.MonkeyPatch, launcher: str = "local") -> FakeStep:
        from loraflow.launchers import registry

        fake = self

        class Fake(registry.LAUNCHERS[launcher]):  # type: ignore[misc, valid-type]
            def __init__(self, compute, identity, prefix) -> None:
                super().__init__(compute, identity, prefix)
                fake.made.append((compute, identity, prefix))

            def run(self, argv, sink, extra_env=None, secrets=None, on_workload=None) -> None:
                fake.run(argv, sink, extra_env or {}, secrets or {})

            def kill(self) -> None:
                fake.kill()

        monkeypatch.setitem(registry.LAUNCHERS, launcher, Fake)
        return self

    def run(self, argv: list[str], sink, env, secrets=None) -> None:
        self.calls.append({"argv": argv, "env": env, "secrets": secrets})
        sink(f"step line {len(self.calls)}")  # the step's output reaches the caller's sink
        flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        stage = argv[2].rsplit(".", 1)[-1]
        artifacts.commit(
            flag["--output"],
            {},
            stage=stage,
            inputs={},
            config={},
            lock_version=flag["--lock-version"],
            cache_key=self.commit_key or flag["--cache-key"],
            summary={"run": len(self.calls)},
        )

    def kill(self) -> None:
        self.killed = True


def upstream_commit(root: str, stage: str, key: str, payload: str = "x") -> str:
    prefix = f"{root}/up-{key}/{stage}"
    artifacts.commit(
        prefix,
        {"f.bin": {"size": len(payload), "crc32c": payload}},
        stage=stage,
        inputs={},
        config={},
        lock_version="l",
        cache_key=key,
        summary={},
    )
    return prefix


@pytest.fixture
def fake_step(monkeypatch: pytest.MonkeyPatch) -> FakeStep:

    return FakeStep().install(monkeypatch)


def test_a_miss_launches_and_caches_a_hit_launches_nothing(parity_spec, fake_step: FakeStep) -> None:
    from loraflow.pipeline import runner

    log: list[str] = []
    first = runner.run_stage(parity_spec, "validate_data", "run-a", {}, log.append)
    prefix = artifacts.stage_prefix(parity_spec.artifact_root, parity_spec.name, "run-a", "validate_data")
    assert first == runner.StageResult("validate_data", f"{prefix}/{artifacts.MANIFEST}", False, {"run": 1})
    key = artifacts.read_manifest(first.manifest).data["cache_key"]
    assert any(f"cache miss for validate_data (key {key})" in line for line in log)
    argv = fake_step.calls[0]["argv"]
    assert argv[1:5] == ["-m", "loraflow.steps.validate_data", "--output", prefix]
    assert argv[argv.index("--cache-key") + 1] == key
    # the step checks each input against the identity the key was computed from
    fingerprints = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--fingerprint"]
    assert fingerprints == [f"{n}={v}" for n, v in sorted(runner.input_fingerprints(runner.resolve_inputs(
        runner.stage_plans(parity_spec)["validate_data"], {})).items())]  # fmt: skip
    assert len(fingerprints) == 3
    assert "step line 1" in log
    assert fake_step.calls[0]["env"] == parity_spec.compute_for("validate_data").env
    assert fake_step.calls[0]["secrets"] == {}

    log.clear()
    second = runner.run_stage(parity_spec, "validate_data", "run-b", {}, log.append)
    assert second == runner.StageResult("validate_data", first.manifest, True, {"run": 1})
    assert len(fake_step.calls) == 1  # nothing launched
    assert any(f"cache hit for validate_data (key {key})" in line for line in log)
    assert second.to_xcom() == {"stage": "validate_data", "manifest": first.manifest, "cached": True,
                                "summary": {"run": 1}}  # fmt: skip


def test_the_cache_key_follows_config_data_and_environment(parity_spec, fake_step: FakeStep, gcs_bucket: str) -> None:
    from loraflow.pipeline import runner
    from loraflow.spec.schema import with_overrides

    def key(spec, stage="validate_data", upstream=None) -> str:
        prepared = runner.prepare_stage(spec, stage, "run-k", upstream or {}, lambda _: None)
        assert isinstance(prepared, runner.PreparedStage)
        return prepared.cache_key

    base = key(parity_spec)
    assert key(parity_spec) == base
    assert key(with_overrides(parity_spec, {"data.expectations.row_count.min": 50})) != base
    plan = runner.stage_plans(parity_spec)["validate_data"]
    prepared = runner.prepare_stage(parity_spec, "validate_data", "run-k", {}, lambda _: None)
    assert isinstance(prepared, runner.PreparedStage)
    assert prepared.stage == "validate_data" and prepared.plan == plan
    fingerprints = runner.input_fingerprints(prepared.inputs)
    assert prepared.fingerprints == fingerprints
    assert prepared.cache_key == artifacts.cache_key(fingerprints, plan.config, plan.env.lock_version())
    assert prepared.lock_version == plan.env.lock_version()
    assert set(fingerprints) == {"train", "eval", "tokenizer"}  # each source by its files' fingerprint
    assert fingerprints["train"] == artifacts.fingerprint(artifacts.source_files(parity_spec.data.train))
    # new bytes in a source: another key
    from loraflow.storage import gcs

    bucket, path = gcs.split_uri(parity_spec.data.train)
    gcs.client().bucket(bucket).blob(path).upload_from_string(b'{"prompt": "a", "completion": "b"}\n')
    assert key(parity_spec) != base


def test_an_upstream_stage_counts_by_its_cache_key_not_its_bytes(parity_spec, fake_step: FakeStep) -> None:
    from loraflow.pipeline import runner

    root = parity_spec.artifact_root
    a = upstream_commit(root, "evaluate_base", "k-base")
    b = upstream_commit(root, "evaluate_tuned", "k-tuned")
    b_other_bytes = upstream_commit(root + "/again", "evaluate_tuned", "k-tuned", payload="other")
    b_other_key = upstream_commit(root, "evaluate_tuned", "k-tuned-2")
    inputs = runner.resolve_inputs(runner.stage_plans(parity_spec)["gate"], {"evaluate_base": a, "evaluate_tuned": b})
    assert inputs == {"base_eval": f"{a}/{artifacts.MANIFEST}", "tuned_eval": f"{b}/{artifacts.MANIFEST}"}
    assert runner.input_fingerprints(inputs) == {"base_eval": "k-base", "tuned_eval": "k-tuned"}

    def key(tuned: str) -> str:
        prepared = runner.prepare_stage(
            parity_spec, "gate", "run-g", {"evaluate_base": a, "evaluate_tuned": tuned}, lambda _: None
        )
        assert isinstance(prepared, runner.PreparedStage)
        return prepared.cache_key

    assert key(b) == key(b_other_bytes)
    assert key(b) != key(b_other_key)


def test_a_missing_upstream_is_refused_unless_optional(parity_spec) -> None:
    from loraflow.errors import LoraflowError
    from loraflow.pipeline import runner

    plans = runner.stage_plans(parity_spec)
    with pytest.raises(LoraflowError, match="gate needs the output of evaluate_tuned, which did not run"):
        runner.resolve_inputs(plans["gate"], {"evaluate_base": "gs://b/x/evaluate_base"})
    # the report's inputs are all optional: the stages that ran, and only those
    assert runner.resolve_inputs(plans["report"], {"gate": "gs://b/x/gate"}) == {
        "gate": f"gs://b/x/gate/{artifacts.MANIFEST}"
    }


def test_a_stage_that_is_never_cached_launches_every_time(parity_spec, fake_step: FakeStep) -> None:
    from loraflow.pipeline import runner

    root = parity_spec.artifact_root
    upstream = {"evaluate_base": upstream_commit(root, "evaluate_base", "kb"),
                "evaluate_tuned": upstream_commit(root, "evaluate_tuned", "kt")}  # fmt: skip
    log: list[str] = []
    first = runner.run_stage(parity_spec, "gate", "run-1", upstream, log.append)
    second = runner.run_stage(parity_spec, "gate", "run-2", upstream, log.append)
    assert not first.cached and not second.cached and first.manifest != second.manifest
    assert len(fake_step.calls) == 2
    assert not any("cache" in line for line in log)
    key = artifacts.read_manifest(first.manifest).data["cache_key"]
    assert artifacts.read_json(artifacts.cache_entry_uri(root, "gate", key)) is None  # no entry written


def test_a_rerun_with_another_key_commits_beside_and_the_same_key_finds_its_own(
    parity_spec, fake_step: FakeStep
) -> None:
    from loraflow.pipeline import runner
    from loraflow.spec.schema import with_overrides

    prefix = artifacts.stage_prefix(parity_spec.artifact_root, parity_spec.name, "run-c", "validate_data")
    assert runner.commit_prefix(prefix, "a" * 64) == prefix  # nothing there yet
    runner.run_stage(parity_spec, "validate_data", "run-c", {}, lambda _: None)
    key = artifacts.read_manifest(prefix).data["cache_key"]
    assert runner.commit_prefix(prefix, key) == prefix
    assert runner.commit_prefix(prefix, "b" * 64) == f"{prefix}-{'b' * 12}"
    # the same run's stage cleared and re-run on another config: beside the first commit, never over it
    changed = with_overrides(parity_spec, {"data.expectations.row_count.min": 50})
    prepared = runner.prepare_stage(changed, "validate_data", "run-c", {}, lambda _: None)
    assert isinstance(prepared, runner.PreparedStage)
    assert prepared.prefix == f"{prefix}-{prepared.cache_key[:12]}" and prepared.cache_key != key


def test_a_commit_for_another_key_fails_the_stage_and_is_not_cached(parity_spec, monkeypatch) -> None:
    from loraflow.pipeline import runner

    FakeStep(commit_key="f" * 64).install(monkeypatch)
    with pytest.raises(
        artifacts.ArtifactError,
        match=r"committed for cache key f{64}, not this attempt's .*: the stage's inputs or config changed under it; re-run the stage",
    ) as err:
        runner.run_stage(parity_spec, "validate_data", "run-d", {}, lambda _: None)
    key = str(err.value).split("not this attempt's ")[1].split(":")[0]
    assert artifacts.cache_lookup(parity_spec.artifact_root, "validate_data", key) is None
    # the commit of the key it was given is verified and cached under that key
    prefix = artifacts.stage_prefix(parity_spec.artifact_root, parity_spec.name, "run-old", "validate_data")
    artifacts.commit(prefix, {}, stage="validate_data", inputs={}, config={}, lock_version="l", cache_key="k",
                     summary={"n": 1})  # fmt: skip
    done = runner.finish_stage(parity_spec, "validate_data", prefix, "k")
    assert done == runner.StageResult("validate_data", f"{prefix}/{artifacts.MANIFEST}", False, {"n": 1})
    hit = artifacts.cache_lookup(parity_spec.artifact_root, "validate_data", "k")
    assert hit is not None and hit.uri == done.manifest


def test_a_failing_step_fails_the_stage_and_caches_nothing(parity_spec, monkeypatch) -> None:
    from loraflow.pipeline import runner

    class Failing(FakeStep):
        def run(self, argv, sink, env, secrets=None) -> None:
            raise StepError("step exited with 1: boom")

    Failing().install(monkeypatch)
    with pytest.raises(StepError, match="boom"):
        runner.run_stage(parity_spec, "validate_data", "run-e", {}, lambda _: None)
    prepared = runner.prepare_stage(parity_spec, "validate_data", "run-e2", {}, lambda _: None)
    assert isinstance(prepared, runner.PreparedStage)  # still a miss


def test_secrets_reach_a_local_step_and_only_their_fingerprint_the_log(parity_spec, fake_step: FakeStep) -> None:
    from loraflow.launchers import credentials
    from loraflow.launchers.local import KillSwitch
    from loraflow.pipeline import runner

    log: list[str] = []
    switch = KillSwitch()
    runner.run_stage(parity_spec, "validate_data", "run-s", {}, log.append, switch, secrets={"HF_TOKEN": "hunter2"})
    assert fake_step.calls[0]["secrets"] == {"HF_TOKEN": "hunter2"}
    assert f"secret HF_TOKEN ({credentials.fingerprint('hunter2')}) passed to the step in its environment" in log
    assert not any("hunter2" in line for line in log)
    assert fake_step.calls[0]["argv"][0] == str(runner.stage_plans(parity_spec)["validate_data"].env.local_python())
    assert "step line 1" in log
    switch.kill()
    assert fake_step.killed  # the kill switch was armed with the launcher


@pytest.mark.parametrize("launcher", ["vertex", "gke"])
def test_a_remote_stage_is_launched_as_its_job_with_plain_python(parity_spec, monkeypatch, launcher: str) -> None:
    from loraflow.errors import LoraflowError
    from loraflow.launchers import registry
    from loraflow.launchers.identity import JobIdentity
    from loraflow.launchers.local import KillSwitch
    from loraflow.pipeline import runner

    compute = compute_from(launcher=launcher, image="us-docker.pkg.dev/p/r/control:1", machine_type="n2-standard-8",
                           env=dict(parity_spec.compute_for("validate_data").env))  # fmt: skip
    spec = parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": compute}})
    step = FakeStep().install(monkeypatch, launcher)
    monkeypatch.setitem(registry.LAUNCHERS, "local", lambda *a: pytest.fail("launched locally"))
    with pytest.raises(
        LoraflowError, match=r"stage validate_data runs on .*, where loraflow does not pass secrets \(A, B\)"
    ):
        runner.run_stage(spec, "validate_data", "run-x", {}, lambda _: None, secrets={"B": "2", "A": "1"})
    assert step.calls == []
    switch = KillSwitch()
    log: list[str] = []
    result = runner.run_stage(spec, "validate_data", f"run-{launcher}", {}, log.append, switch, dag_id="d1")
    key = artifacts.read_manifest(result.manifest).data["cache_key"]
    (made_compute, identity, prefix) = step.made[-1]
    assert made_compute == compute and prefix == result.manifest.rsplit("/", 1)[0]
    assert identity == JobIdentity("d1", f"run-{launcher}", "validate_data", key)
    where = {"vertex": "on Vertex AI", "gke": "on GKE"}[launcher]
    assert any(line.startswith(f"launching loraflow.steps.validate_data {where}") for line in log)
    assert "step line 1" in log
    assert step.calls[0]["argv"][0] == "python" and step.calls[0]["env"] == compute.env
    switch.kill()
    assert step.killed


def test_a_launcher_this_version_cannot_start_is_refused_with_the_key(parity_spec) -> None:
    from loraflow.errors import LoraflowError
    from loraflow.pipeline import runner

    compute = parity_spec.compute_for("validate_data").model_construct(launcher="slurm")
    spec = parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": compute}})
    with pytest.raises(LoraflowError, match=r"set compute\.validate_data\.launcher to local, vertex or gke"):
        runner.prepare_stage(spec, "validate_data", "run-l", {}, lambda _: None)


def test_remote_jobs_are_named_after_dag_run_stage_and_key(parity_spec) -> None:
    from loraflow.launchers.gke import GkeLauncher
    from loraflow.launchers.vertex import VertexLauncher
    from loraflow.pipeline import runner

    remote = {"image": "us-docker.pkg.dev/p/r/control:1", "machine_type": "n2-standard-8", "hosts": 2}
    for launcher, cls in (("vertex", VertexLauncher), ("gke", GkeLauncher)):
        compute = compute_from(launcher=launcher, **remote)
        spec = parity_spec.model_copy(update={"compute": {**parity_spec.compute, "validate_data": compute}})
        for dag_id, expected in ((None, spec.name), ("d2", "d2")):
            made = runner.launcher_for(spec, "validate_data", "run-v", "k" * 64, "gs://b/p", dag_id)
            assert type(made) is cls and made.compute == compute  # the stage's own section
            assert made.output_prefix == "gs://b/p"
            identity = made.identity
            assert (identity.dag_id, identity.run_id, identity.stage, identity.cache_key) == (
                expected,
                "run-v",
                "validate_data",
                "k" * 64,
            )
