"""lora_sft as a 2- and a 4-host job on loopback equals the 1-host run; a lost host fails the job, the
retry resumes; a host whose data pipeline fails fails the job at once, named: jax.distributed for real, on CPU.

Every run is the real step program (``python -m loraflow.steps.lora_sft``; each host of a job started
through ``every_host_caches.py``, which changes only that every host, not process 0 alone, keeps its
compilations in the session's cache) through the harness against the GCS emulator, with the same
inputs, config and seed, and 4 CPU devices in total: one process with 4 devices, then N processes with 4/N devices each that find each other through
``LORAFLOW_COORDINATOR`` on 127.0.0.1 (what ``loraflow.launchers.multihost`` reads; Vertex's CLUSTER_SPEC and
GKE's env lead to the same ``jax.distributed.initialize`` call). MaxText's mesh then spans both
processes: the parameters are sharded across them and each loads its share of every batch.

The processes are separate hosts (``tests/separate_hosts.py``): each has its own HOME, TMPDIR,
scratch and working directory; they share nothing but GCS. Both checkpoint modes run there: ``staged``
(every host writes its own shards to its own disk and uploads its part to
``_checkpoints/<step>/host-<i>/``; host 0 commits a step once every host has uploaded; a resume
fetches each host's own part of the newest committed step) and ``direct`` (Orbax writes gs://
through tensorstore's GCS driver, pointed at the emulator). The 1-host reference is staged.

``shuffle`` is on (loraflow orders the examples itself, the same file on every host:
``loraflow.data.epochs``); ``packing`` is off: MaxText packs each host's share of the stream by
itself, so packed rows (and with them the examples of a step) depend on the host count.
About 6 minutes on 2 shared CPU cores (374 s wall, 319 CPU s at load 3 to 7, 2026-12-07), most of it the
processes importing MaxText and compiling side by side; 243 s with the data-failure job at a lower load
(2026-12-07 08:16; that job's hosts stop at their 2nd batch: 39-43 s alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).parent))

import pytest

pytest.importorskip("maxtext")

from test_trainer_steps import OVERRIDES

from loraflow.dev.local_gcs import free_port
from loraflow.launchers.local import step_environment
from loraflow.storage import artifacts, checkpoint_sync, gcs
from tests.separate_hosts import host_dirs

CONFIG = {
    "model_name": "llama3.1-8b",
    "model_overrides": OVERRIDES,
    "rank": 8,
    "alpha": 16,
    "target_modules": None,
    "steps": 4,
    "batch_size": 8,
    "learning_rate": 3e-3,
    "max_length": 64,
    "seed": 0,
    "checkpoint_period": 2,
    "dtype": "float32",
    "packing": False,
    "shuffle": True,
}


@pytest.fixture(scope="module")
def sources(base, gcs_emulator):
    root = f"gs://{gcs_emulator.bucket}/multihost"
    ckpt = f"{root}/src/convert_checkpoint"
    files = artifacts.upload_tree(base["ckpt"], ckpt)
    manifest = artifacts.commit(
        ckpt, files, stage="convert_checkpoint", inputs={}, config={}, lock_version="L", cache_key="C", summary={}
    )
    artifacts.upload_tree(base["dataset"], f"{root}/src/dataset")
    artifacts.upload_tree(base["hf"], f"{root}/src/hf")
    return {"root": root, "checkpoint": manifest.uri}


def _argv(sources: dict[str, str], output: str, **config: object) -> list[str]:
    root = sources["root"]
    return [
        sys.executable, "-m", "loraflow.steps.lora_sft", "--output", output,
        "--input", f"checkpoint={sources['checkpoint']}", "--input", f"dataset={root}/src/dataset",
        "--input", f"tokenizer={root}/src/hf", "--config-json", json.dumps(CONFIG | config), "--cache-key", "K",
    ]  # fmt: skip


DEVICES = 4  # in every run, split evenly over its processes
# runs a host's step program keeping its compilations whatever its process id (JAX's own rule: process 0 only)
EVERY_HOST_CACHES = Path(__file__).parent / "every_host_caches.py"
# the same, its data pipeline raising at the N-th batch where LORAFLOW_TEST_PIPELINE_FAILS_AT=N
FAILING_PIPELINE = Path(__file__).parent / "failing_pipeline.py"


def _env(devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **step_environment(extra or {})}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _adapter(output: str, dest: Path) -> dict:
    from safetensors.numpy import load_file

    artifacts.fetch(artifacts.read_manifest(output), dest, only=["peft/adapter_model.safetensors"])
    return load_file(str(dest / "peft" / "adapter_model.safetensors"))


def _assert_same_adapter(reference: dict, other: dict, tolerance: float) -> None:
    import numpy as np

    assert reference.keys() == other.keys() and len(reference) == 28
    scale = max(float(np.max(np.abs(v))) for v in reference.values())
    worst = max(float(np.max(np.abs(reference[k] - other[k]))) for k in reference)
    assert scale > 0.01  # the adapter moved: equality is not two zero adapters
    assert worst <= tolerance * scale, (worst, scale)


def _run_hosts(
    sources: dict[str, str],
    output: str,
    root: Path,
    n: int,
    env_of: dict[int, dict[str, str]] | None = None,
    storage: str = "direct",
    program: Path = EVERY_HOST_CACHES,
    limit: float = 900,
) -> tuple[list[int], list[str], list[float]]:
    """lora_sft as ``n`` separate hosts, each ``python program loraflow.steps.lora_sft ...``, the ones still
    running after ``limit`` seconds killed; (exit codes, logs, when each process exited: seconds from the
    start, inf for one killed)."""
    wiring = {"LORAFLOW_COORDINATOR": f"127.0.0.1:{free_port()}", "LORAFLOW_NUM_PROCESSES": str(n)}
    hosts = [host_dirs(root, f"host{i}") for i in range(n)]
    started = time.monotonic()
    procs, logs = [], []
    for i, (disk, cwd) in enumerate(hosts):
        logs.append((cwd / "lora_sft.log").open("w+"))
        env = _env(DEVICES // n, {**wiring, "LORAFLOW_PROCESS_ID": str(i), **disk, **(env_of or {}).get(i, {})})
        argv = _argv(sources, output, checkpoint_storage=storage)
        argv[1:2] = [str(program)]  # python every_host_caches.py loraflow.steps.lora_sft ...
        procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=logs[i], stderr=subprocess.STDOUT))
    exited: dict[int, float] = {}
    try:
        while len(exited) < n and time.monotonic() - started < limit:
            exited |= {
                i: time.monotonic() - started for i, p in enumerate(procs) if i not in exited and p.poll() is not None
            }
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return [p.returncode for p in procs], texts, [exited.get(i, float("inf")) for i in range(n)]


def test_every_host_of_a_job_keeps_its_compilations_with_this_jax():
    """every_host_caches.py replaces this JAX's cache writer: with another JAX every host but process 0
    would compile everything again in each job, the module minutes slower and nothing failing."""
    import every_host_caches

    assert every_host_caches.applies()


@pytest.fixture(scope="module")
def single(sources, tmp_path_factory):
    """The reference: one process with every device, checkpoints staged on its disk (the default)."""
    output = f"{sources['root']}/single/lora_sft"
    disk, cwd = host_dirs(tmp_path_factory.mktemp("single"), "host0")
    run = subprocess.run(_argv(sources, output), env=_env(DEVICES, disk), cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"output": output, "adapter": _adapter(output, tmp_path_factory.mktemp("single-adapter"))}


def _checkpoint_names(output: str) -> list[str]:
    bucket, prefix = gcs.split_uri(output + "/_checkpoints")
    return sorted(b.name[len(prefix) + 1 :] for b in gcs.client().list_blobs(bucket, prefix=prefix + "/"))


@pytest.mark.parametrize(("n", "storage"), [(2, "staged"), (4, "direct")])
def test_n_processes_as_n_hosts_train_the_single_process_adapter(sources, single, n, storage, tmp_path):
    multi_out = f"{sources['root']}/multi{n}-{storage}/lora_sft"
    codes, logs, _ = _run_hosts(sources, multi_out, tmp_path / "hosts", n, storage=storage)
    assert codes == [0] * n, "\n----\n".join(log[-2000:] for log in logs)

    # One job of n processes, its parameters split across them; process 0 alone committed.
    assert f"process {n - 1} of {n}: {DEVICES // n} local of {DEVICES} cpu devices" in logs[-1]
    sharded = next(line for line in logs[0].splitlines() if "sharded across processes" in line)
    assert f"over {n} processes" in sharded and " 0 of " not in sharded, sharded
    assert "committed" in logs[0] and not any("committed" in log for log in logs[1:])
    assert all("no output uploaded" in log for log in logs[1:])
    manifest = artifacts.read_manifest(multi_out)
    assert manifest.summary["processes"] == n and manifest.summary["steps"] == CONFIG["steps"]
    # Nothing beside the committed files and the checkpoints under the stage's prefix.
    bucket, prefix = gcs.split_uri(multi_out)
    names = {b.name[len(prefix) + 1 :] for b in gcs.client().list_blobs(bucket, prefix=prefix + "/")}
    stray = {n for n in names if not n.startswith("_checkpoints/")} - set(manifest.files) - {artifacts.MANIFEST}
    assert not stray, stray
    if storage == "direct":
        # Orbax wrote every checkpoint (steps 2 and 4) to GCS itself, and committed each one there.
        committed = {n.split("/")[-2] for n in names if n.endswith("/commit_success.txt")}
        assert {"2", "4"} <= committed, sorted(names)[:20]
        assert not any("tmp" in n.split("/")[-2] for n in names if n.startswith("_checkpoints/")), "uncommitted left"
        assert all(f"checkpoints: Orbax writes them to {multi_out}/_checkpoints (direct)" in log for log in logs)
    else:
        _assert_staged_by_every_host(multi_out, logs, n)

    _assert_same_adapter(single["adapter"], _adapter(multi_out, tmp_path / "multi"), 1e-4)
    assert artifacts.read_manifest(single["output"]).summary["first_loss"] == pytest.approx(
        manifest.summary["first_loss"], rel=1e-5
    )


def _assert_staged_by_every_host(output: str, logs: list[str], n: int) -> None:
    """Staged on n hosts: the newest steps committed once, each holding every host's own part, each part
    uploaded by its host; host 0 alone committed."""
    remote = output + "/_checkpoints"
    steps = checkpoint_sync.remote_steps(remote)
    assert steps[-1] == CONFIG["steps"] and len(steps) <= 2, steps  # the newest two kept
    names = _checkpoint_names(output)
    for step in steps:
        marker = artifacts.read_json(f"{remote}/{step}/{checkpoint_sync.MARKER}")
        assert marker["hosts"] == n
        for host in range(n):
            part = {k for k in marker["files"] if k.startswith(f"host-{host}/")}
            # Every host's part carries its own shards (ocdbt.process_<host>) and Orbax's metadata.
            assert any(f"/ocdbt.process_{host}/" in k for k in part), sorted(part)
            assert f"host-{host}/model_params/_METADATA" in part, sorted(part)
            assert f"{step}/host-{host}/{checkpoint_sync.HOST_MARKER}" in names
            assert f"checkpoint step {step}: host {host}'s part persisted to {remote}/{step}/host-{host}" in logs[host]
        assert f"checkpoint step {step} committed: all {n} hosts uploaded their parts" in logs[0]
    assert not any("committed: all" in log for log in logs[1:])
    # Nothing under _checkpoints but the kept steps.
    assert {int(name.split("/")[0]) for name in names} == set(steps), names[:20]


HEARTBEAT = 10  # seconds without a host before the others give up (production: 100)


def test_a_lost_host_fails_the_whole_job_and_the_retry_resumes_to_the_same_adapter(sources, single, tmp_path):
    """SIGKILL a worker mid-training, then (on the retry) the coordinator: each time every other host
    stops within a bounded time instead of waiting in a collective; the next try resumes from the
    newest checkpoint Orbax committed in GCS and trains the uninterrupted run's adapter."""
    output = f"{sources['root']}/lost/lora_sft"
    bound = HEARTBEAT + 60  # the heartbeat, plus JAX noticing it and the process exiting on 2 busy cores
    state = tmp_path / "faults"

    def fault(process: int, at: str) -> dict[int, dict[str, str]]:
        env = {"LORAFLOW_HEARTBEAT_TIMEOUT": str(HEARTBEAT), "LORAFLOW_FAULT_STATE": str(state / str(process))}
        return {i: env | ({"LORAFLOW_FAULT": at} if i == process else {}) for i in range(2)}

    # Killed at the end of step 3 of 4 (the first try), then of the step after the resumed one.
    for attempt, (process, at) in enumerate([(1, "train_step@3"), (0, "train_step@1")]):
        codes, logs, seconds = _run_hosts(sources, output, tmp_path / f"try{attempt}", 2, fault(process, at))
        assert codes[process] == -9, logs[process][-2000:]
        other = 1 - process
        assert codes[other] != 0, logs[other][-2000:]
        assert seconds[other] - seconds[process] <= bound, (seconds, logs[other][-2000:])
        print(
            f"[lost host] process {process} killed: process {other} stopped {seconds[other] - seconds[process]:.1f}s later"
        )
        with pytest.raises(Exception, match="missing"):
            artifacts.read_manifest(output)

    codes, logs, _ = _run_hosts(sources, output, tmp_path / "retry", 2, fault(0, ""))
    assert codes == [0, 0], logs[0][-3000:]
    done = artifacts.read_manifest(output)
    assert done.summary["resumed_from_step"] in (1, 2)  # Tunix checkpoints step 1, then every period
    _assert_same_adapter(single["adapter"], _adapter(output, tmp_path / "resumed"), 1e-3)


def test_a_data_pipeline_failing_on_one_host_fails_the_whole_job_named(sources, tmp_path):
    """Process 1's data pipeline raises at its 2nd batch (MaxText logs it and would end that host's loop as if
    the data had run out, while process 0 waits in step 2's collective for it): process 1 fails at once
    naming the exception, process 0 stops within a bounded time instead of waiting, nothing is committed."""
    import failing_pipeline

    output = f"{sources['root']}/data-failure/lora_sft"
    env = {"LORAFLOW_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    env_of = {0: env, 1: env | {failing_pipeline.FAILS_AT: "2"}}
    bound = HEARTBEAT + 60  # as for a lost host
    # setting up both hosts takes 1-2 minutes; without the fix process 0 would wait out JAX's timeouts
    codes, logs, seconds = _run_hosts(sources, output, tmp_path, 2, env_of, program=FAILING_PIPELINE, limit=300)
    print(
        f"[data failure] process 1 exited at {seconds[1]:.1f}s ({codes[1]}), process 0 at {seconds[0]:.1f}s ({codes[0]})"
    )
    assert codes[1] not in (0, -9), logs[1][-3000:]  # failed, not killed at the limit
    assert (
        f"training stopped at step 1 of {CONFIG['steps']}: the data pipeline failed: ValueError: "
        f"{failing_pipeline.MESSAGE} (its traceback is in the task log above)"
    ) in logs[1], logs[1][-3000:]
    assert "Traceback (most recent call last):" in logs[1]
    assert codes[0] not in (0, -9), logs[0][-3000:]
    assert seconds[0] - seconds[1] <= bound, (seconds, logs[0][-2000:])
    with pytest.raises(Exception, match="missing"):
        artifacts.read_manifest(output)
    bucket, prefix = gcs.split_uri(output)
    names = [b.name[len(prefix) + 1 :] for b in gcs.client().list_blobs(bucket, prefix=prefix + "/")]
    assert not [n for n in names if not n.startswith("_checkpoints/")], names  # no adapter, no outputs


def test_staged_a_host_lost_while_uploading_its_part_leaves_the_step_uncommitted_and_the_retry_resumes(
    sources, single, tmp_path
):
    """Staged on 2 hosts: host 1 is SIGKILLed after uploading its files of the last step (4) but before
    its part's marker. Host 0 has uploaded its part; it must not commit step 4 (not every host
    uploaded), and the job fails. The retry - new hosts, empty disks - resumes every host from its
    own part of the newest committed step (2, or 1 when step 2's upload was still pending when the
    host died: Orbax finalises asynchronously), never from the uploaded half of step 4, and trains the
    uninterrupted run's adapter."""
    output = f"{sources['root']}/lost-staged/lora_sft"
    remote = output + "/_checkpoints"
    state = tmp_path / "faults"

    def fault(at: str) -> dict[int, dict[str, str]]:
        env = {"LORAFLOW_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
        return {i: env | {"LORAFLOW_FAULT_STATE": str(state / str(i))} | ({"LORAFLOW_FAULT": at} if i == 1 else {})
                for i in range(2)}  # fmt: skip

    # Host 1's uploads: steps 1, 2 and 4 (Tunix checkpoints step 1, then every period and the last).
    codes, logs, _ = _run_hosts(sources, output, tmp_path / "try0", 2, fault("checkpoint_upload@3"), storage="staged")
    assert codes[1] == -9, logs[1][-2000:]
    assert codes[0] != 0, logs[0][-2000:]
    assert "checkpoint step 4: host 0's part persisted" in logs[0], logs[0][-3000:]
    names = _checkpoint_names(output)
    assert f"4/host-0/{checkpoint_sync.HOST_MARKER}" in names and any(n.startswith("4/host-1/") for n in names)
    assert f"4/host-1/{checkpoint_sync.HOST_MARKER}" not in names
    # Read from the bucket, not through checkpoint_sync: the steps holding a commit marker.
    committed = sorted(int(n.split("/")[0]) for n in names if n.count("/") == 1 and n.endswith(checkpoint_sync.MARKER))
    assert committed and committed[-1] in (1, 2), names  # step 4 is not committed
    with pytest.raises(Exception, match="missing"):
        artifacts.read_manifest(output)

    codes, logs, _ = _run_hosts(sources, output, tmp_path / "retry", 2, fault(""), storage="staged")
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for host in range(2):
        assert f"found checkpoint step {committed[-1]} under {remote}: host {host} resumes from its part" in logs[host]
    done = artifacts.read_manifest(output)
    print(f"[lost host, staged] step 4 left uncommitted; the retry resumed from step {committed[-1]}")
    assert done.summary["resumed_from_step"] == committed[-1]
    assert checkpoint_sync.remote_steps(remote)[-1] == CONFIG["steps"]
    _assert_same_adapter(single["adapter"], _adapter(output, tmp_path / "resumed"), 1e-3)
