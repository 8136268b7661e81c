"""The step harness checks each upstream stage it reads against the identity the cache key was computed
from (``artifacts.input_identity``: the upstream's own cache key, or its files' fingerprint for a
manifest without one) before it fetches anything; a data source's check is in test_trust_bucket.py.

A stand-in step program (``run_step`` in this process) reads one upstream artifact committed on the GCS
emulator; the argv is what the runner builds (``--input``, ``--fingerprint``, ``--cache-key``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.steps._harness import StepContext, run_step
from loraflow.storage import artifacts

CONFIG = {"threshold": 1}
LOCK = "lock-1"


def _commit_upstream(prefix: str, tmp_path: Path, text: str, cache_key: str) -> artifacts.Manifest:
    folder = tmp_path / f"up-{cache_key or 'none'}-{len(text)}"
    folder.mkdir()
    (folder / "answer.txt").write_text(text)
    files = artifacts.upload_tree(folder, prefix)
    return artifacts.commit(
        prefix, files, stage="merge_adapter", inputs={}, config={}, lock_version=LOCK, cache_key=cache_key, summary={}
    )


def _step(ctx: StepContext) -> dict[str, str]:
    (ctx.out / "read.txt").write_text((ctx.inputs["model"] / "answer.txt").read_text())
    return {"read": (ctx.inputs["model"] / "answer.txt").read_text()}


def _argv(output: str, manifest_uri: str, identity: str) -> list[str]:
    key = artifacts.cache_key({"model": identity}, CONFIG, LOCK)
    return [
        "--output", output, "--input", f"model={manifest_uri}", "--fingerprint", f"model={identity}",
        "--config-json", json.dumps(CONFIG), "--lock-version", LOCK, "--cache-key", key,
    ]  # fmt: skip


@pytest.mark.parametrize("upstream_key", ["k-upstream-1", ""], ids=["its-cache-key", "its-files"])
def test_a_step_reads_an_upstream_whose_identity_is_what_its_key_was_computed_from(
    gcs_bucket: str, tmp_path: Path, upstream_key: str
) -> None:
    manifest = _commit_upstream(f"{gcs_bucket}/run/merge_adapter", tmp_path, "4", upstream_key)
    identity = upstream_key or manifest.fingerprint
    assert artifacts.input_identity(manifest) == identity
    output = f"{gcs_bucket}/run/evaluate_tuned"
    assert run_step("evaluate_tuned", _step, _argv(output, manifest.uri, identity)) == 0
    committed = artifacts.read_manifest(output)
    assert committed.summary["read"] == "4"
    assert committed.data["inputs"]["model"]["uri"] == manifest.uri
    assert committed.data["cache_key"] == artifacts.cache_key({"model": identity}, CONFIG, LOCK)


@pytest.mark.parametrize("upstream_key", ["k-upstream-2", ""], ids=["its-cache-key", "its-files"])
def test_an_upstream_that_changed_after_the_key_was_computed_is_refused_before_anything_is_fetched(
    gcs_bucket: str, tmp_path: Path, upstream_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runner computed the key from the upstream committed then (``k-upstream-1``, or its files'
    fingerprint); what the step finds under that prefix now is another commit (a re-run, a bucket writer):
    refused, exit 2, naming the input and both identities; nothing committed under the key."""
    seen = _commit_upstream(f"{gcs_bucket}/before/merge_adapter", tmp_path, "4", "k-upstream-1" if upstream_key else "")
    prefix = f"{gcs_bucket}/run/merge_adapter"
    now = _commit_upstream(prefix, tmp_path, "5 (changed)", upstream_key)
    before, after = artifacts.input_identity(seen), artifacts.input_identity(now)
    assert before != after
    output = f"{gcs_bucket}/run/evaluate_tuned"
    calls: list[StepContext] = []
    assert run_step("evaluate_tuned", lambda ctx: calls.append(ctx) or {}, _argv(output, now.uri, before)) == 2
    err = capsys.readouterr().err
    assert f"input model ({now.uri}) is not what cache key" in err
    assert f"its fingerprint is now {after}, the runner saw {before}" in err
    assert calls == [] and artifacts.read_json(f"{output}/{artifacts.MANIFEST}") is None
