"""lora_sft as a 2-host job on loopback equals the 1-host run: jax.distributed for real, on CPU.

Both runs are the real step program (``python -m loraflow.steps.lora_sft``) through the harness
against the GCS emulator, with the same inputs, config and seed, and 2 CPU devices in total: one
process with 2 devices, then two processes with 1 device each that find each other through
``LORAFLOW_COORDINATOR`` on 127.0.0.1 (what ``loraflow.launchers.multihost`` reads; Vertex's CLUSTER_SPEC and
GKE's env lead to the same ``jax.distributed.initialize`` call). MaxText's mesh then spans both
processes: the parameters are sharded across them and each loads half of every batch.

The two processes are separate hosts (``tests/separate_hosts.py``): each has its own HOME, TMPDIR,
scratch and working directory; they share nothing but GCS. So the multi-host run writes its
checkpoints with ``checkpoint_storage: direct`` (Orbax writes gs:// through tensorstore's GCS driver,
pointed at the emulator), while the 1-host reference uses the default ``staged`` storage.

``packing`` and ``shuffle`` are off: MaxText's loader gives each host its own shards of a shuffled
stream and packs per host, so only then do both runs train on the same examples in every step.
~4 minutes on 2 CPU cores (mostly the two processes compiling side by side).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).parent))

import pytest

pytest.importorskip("maxtext")

from test_trainer_steps import OVERRIDES, base  # noqa: F401  (the converted tiny model, a module fixture)

from loraflow.dev.local_gcs import free_port
from loraflow.launchers.local import step_environment
from loraflow.pipeline import artifacts, gcs
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
    "shuffle": False,
}


@pytest.fixture(scope="module")
def sources(base, gcs_emulator):  # noqa: F811
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


def _env(devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **step_environment(extra or {})}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _adapter(output: str, dest: Path) -> dict:
    from safetensors.numpy import load_file

    artifacts.fetch(artifacts.read_manifest(output), dest, only=["peft/adapter_model.safetensors"])
    return load_file(str(dest / "peft" / "adapter_model.safetensors"))


def test_two_processes_on_loopback_train_the_single_process_adapter(sources, tmp_path):
    import numpy as np

    single_out = f"{sources['root']}/single/lora_sft"
    single = subprocess.run(_argv(sources, single_out), env=_env(2), capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]

    multi_out = f"{sources['root']}/multi/lora_sft"
    wiring = {"LORAFLOW_COORDINATOR": f"127.0.0.1:{free_port()}", "LORAFLOW_NUM_PROCESSES": "2"}
    hosts = [host_dirs(tmp_path / "hosts", f"host{i}") for i in range(2)]
    procs = [
        subprocess.Popen(
            _argv(sources, multi_out, checkpoint_storage="direct"),
            env=_env(1, {**wiring, "LORAFLOW_PROCESS_ID": str(i), **disk}),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, (disk, cwd) in enumerate(hosts)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=900)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + "\n----\n" + logs[1][-3000:]

    # One job of two processes, its parameters split across them; process 0 alone committed.
    assert "process 1 of 2: 1 local of 2 cpu devices" in logs[1]
    sharded = next(line for line in logs[0].splitlines() if "sharded across processes" in line)
    assert "over 2 processes" in sharded and " 0 of " not in sharded, sharded
    assert "committed" in logs[0] and "committed" not in logs[1]
    assert "nothing uploaded" in logs[1]
    manifest = artifacts.read_manifest(multi_out)
    assert manifest.summary["processes"] == 2 and manifest.summary["steps"] == CONFIG["steps"]
    # Nothing beside the committed files and the persisted checkpoints under the stage's prefix.
    bucket, prefix = gcs.split_uri(multi_out)
    names = {b.name[len(prefix) + 1 :] for b in gcs.client().list_blobs(bucket, prefix=prefix + "/")}
    stray = {n for n in names if not n.startswith("_checkpoints/")} - set(manifest.files) - {artifacts.MANIFEST}
    assert not stray, stray
    # Orbax wrote every checkpoint (steps 2 and 4) to GCS itself, and committed each one there.
    committed = {n.split("/")[-2] for n in names if n.endswith("/commit_success.txt")}
    assert {"2", "4"} <= committed, sorted(names)[:20]
    assert not any("tmp" in n.split("/")[-2] for n in names if n.startswith("_checkpoints/")), "uncommitted left"
    assert all(f"checkpoints: Orbax writes them to {multi_out}/_checkpoints (direct)" in log for log in logs)

    reference, distributed = _adapter(single_out, tmp_path / "single"), _adapter(multi_out, tmp_path / "multi")
    assert reference.keys() == distributed.keys() and len(reference) == 28
    scale = max(float(np.max(np.abs(v))) for v in reference.values())
    worst = max(float(np.max(np.abs(reference[k] - distributed[k]))) for k in reference)
    assert scale > 0.01  # the adapter moved: equality is not two zero adapters
    assert worst <= 1e-4 * scale, (worst, scale)
    assert artifacts.read_manifest(single_out).summary["first_loss"] == pytest.approx(
        manifest.summary["first_loss"], rel=1e-5
    )
