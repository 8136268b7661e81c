"""Worker loss: a step program never outlives its task, and of two writers of one stage prefix exactly
one commits (decided by GCS's create-only precondition, never by reading back)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraflow import artifacts, gcs
from loraflow.errors import ArtifactError


def commit_as(prefix: str, writer: str) -> artifacts.Manifest:
    return artifacts.commit(
        prefix,
        {"model.bin": {"size": 1, "crc32c": "AAAAAA=="}},
        stage="merge_adapter",
        inputs={},
        config={},
        lock_version="t",
        cache_key="k",
        summary={"writer": writer},
    )


def test_two_writers_of_one_stage_prefix_exactly_one_commits(strict_gcs_bucket: str) -> None:
    """Both writers have uploaded and both commit at once: GCS lets one manifest in and refuses the other."""
    prefix = gcs.join(strict_gcs_bucket, "tiny", "run-1", "merge_adapter")
    writers = ["old-step", "retry"]
    ready = threading.Barrier(len(writers))

    def commit(writer: str) -> str:
        ready.wait(timeout=300)  # a guard against a hang, not a measurement
        try:
            commit_as(prefix, writer)
            return "committed"
        except ArtifactError as exc:
            return str(exc)

    with ThreadPoolExecutor(len(writers)) as pool:
        outcomes = dict(zip(writers, pool.map(commit, writers), strict=True))
    winners = [w for w, outcome in outcomes.items() if outcome == "committed"]
    assert len(winners) == 1, outcomes
    (loser,) = set(writers) - set(winners)
    assert "committed by another writer first" in outcomes[loser] and "never overwritten" in outcomes[loser]
    assert artifacts.MANIFEST in outcomes[loser] and "merge_adapter" in outcomes[loser]
    assert artifacts.read_manifest(prefix).summary["writer"] == winners[0]


def test_a_commit_never_replaces_a_committed_manifest(strict_gcs_bucket: str) -> None:
    prefix = gcs.join(strict_gcs_bucket, "tiny", "run-1", "gate")
    commit_as(prefix, "first")
    with pytest.raises(ArtifactError, match="committed by another writer first"):
        commit_as(prefix, "second")
    assert artifacts.read_manifest(prefix).summary["writer"] == "first"
