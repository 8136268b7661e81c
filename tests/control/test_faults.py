"""A step program killed with SIGKILL at any point of its commit never leaves a usable partial
artifact, and its retry completes the stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow import artifacts, gcs
from loraflow.errors import ArtifactError
from loraflow.launch import step_environment

# A tiny step program using the real harness: three output files, then commit.
STEP = """
import sys
from loraflow.steps._harness import run_step
def run(ctx):
    for i in range(3):
        (ctx.out / f"part-{i}.bin").write_bytes(bytes([i]) * 1000)
    return {"parts": 3}
raise SystemExit(run_step("toy", run, sys.argv[1:]))
"""


def run_toy(output: str, fault: str, state: Path) -> int:
    env = step_environment({"LORAFLOW_FAULT": fault, "LORAFLOW_FAULT_STATE": str(state)})
    argv = [sys.executable, "-c", STEP, "--output", output, "--cache-key", "K"]
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True).returncode


@pytest.mark.parametrize("point", ["mid_upload", "before_manifest"])
def test_killed_commit_leaves_no_artifact_and_the_retry_completes(gcs_bucket: str, tmp_path: Path, point: str) -> None:
    output = f"{gcs_bucket}/p/run/toy"
    assert run_toy(output, point, tmp_path) == -9  # SIGKILL
    bucket, base = gcs.split_uri(output)
    left = [b.name for b in gcs.client().list_blobs(bucket, prefix=base + "/")]
    assert left, "the kill should come after some files were uploaded"
    assert not any(n.endswith(artifacts.MANIFEST) for n in left)
    with pytest.raises(ArtifactError, match="missing"):
        artifacts.read_manifest(output)  # readers refuse the partial prefix

    assert run_toy(output, point, tmp_path) == 0  # the retry: the fault fires only once
    manifest = artifacts.read_manifest(output)
    assert sorted(manifest.files) == ["part-0.bin", "part-1.bin", "part-2.bin"]
    artifacts.fetch(manifest, tmp_path / "fetched")  # every listed file exists and verifies


def test_without_the_variables_nothing_is_injected(gcs_bucket: str, tmp_path: Path) -> None:
    assert run_toy(f"{gcs_bucket}/p/run/toy", "", tmp_path) == 0
