"""A step program killed with SIGKILL at any point of its commit never leaves a usable partial
artifact, and its retry completes the stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError
from loraflow.launchers.local import step_environment
from loraflow.storage import artifacts, gcs

REPO = Path(__file__).resolve().parents[2]

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


def test_one_variable_arms_several_stages_each_killed_once(gcs_bucket: str, tmp_path: Path) -> None:
    """``STAGE:POINT`` entries fire only in the step writing that stage, once each per state dir."""
    fault = "other:mid_upload,toy:before_manifest,toy:mid_upload@2"
    out = f"{gcs_bucket}/p/run/toy"
    assert run_toy(out, fault, tmp_path) == -9  # the second upload of toy: mid_upload@2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.mid_upload"]
    assert run_toy(out, fault, tmp_path) == -9  # then before_manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.before_manifest", "toy.mid_upload"]
    assert run_toy(out, fault, tmp_path) == 0  # other:mid_upload never fires in toy
    assert sorted(artifacts.read_manifest(out).files) == ["part-0.bin", "part-1.bin", "part-2.bin"]
    # In another stage's step the other entry fires, once.
    other = f"{gcs_bucket}/p/run/other"
    assert run_toy(other, fault, tmp_path) == -9
    assert run_toy(other, fault, tmp_path) == 0


def test_a_stage_name_only_matches_the_last_segment_of_the_output(gcs_bucket: str, tmp_path: Path) -> None:
    # evaluate_base and evaluate_tuned run the same program; the output prefix tells them apart.
    assert run_toy(f"{gcs_bucket}/p/evaluate_tuned/evaluate_base", "evaluate_tuned:mid_upload", tmp_path) == 0
    assert run_toy(f"{gcs_bucket}/p/run/evaluate_tuned", "evaluate_tuned:mid_upload", tmp_path) == -9


def test_a_pipeline_scoped_entry_fires_only_in_that_pipelines_stage(gcs_bucket: str, tmp_path: Path) -> None:
    """``PIPELINE/STAGE:POINT`` fires in that stage of that pipeline's runs only (``{root}/PIPELINE/RUN/STAGE``):
    a stack running other pipelines' steps beside it kills none of theirs."""
    fault = "faulty/toy:mid_upload"
    assert run_toy(f"{gcs_bucket}/other/run/toy", fault, tmp_path) == 0
    assert run_toy(f"{gcs_bucket}/faulty/run/other", fault, tmp_path) == 0
    assert not list(tmp_path.iterdir())
    assert run_toy(f"{gcs_bucket}/faulty/run/toy", fault, tmp_path) == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faulty.toy.mid_upload"]
    assert run_toy(f"{gcs_bucket}/faulty/run/toy", fault, tmp_path) == 0  # once


def test_the_retry_policy_fails_refusals_at_once_and_retries_crashes() -> None:
    from loraflow.errors import SpecError, StepError
    from loraflow.launchers.local import StepRefused
    from loraflow.spec.schema import load_spec
    from operators.dag_factory import retry_args

    args = retry_args(load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml").model_dump(mode="json")["retry"])
    assert args["retries"] == 2 and args["retry_exponential_backoff"] == 2.0
    policy = args["retry_policy"]
    assert policy.evaluate(StepRefused("bad data"), 1, 3).action.value == "fail"
    assert policy.evaluate(SpecError("x", [("a", "b")]), 1, 3).action.value == "fail"
    assert policy.evaluate(StepError("killed by signal 9"), 1, 3).action.value == "default"
