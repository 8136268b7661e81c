"""Staged checkpoints of several hosts (``checkpoint_sync.HostSyncer``): each host uploads its own part,
host 0 commits a step once every host has uploaded it, and a resume fetches a host's own part of the
newest committed step only.

Two threads stand in for two hosts, each with its own local directory; ``agree`` is the collective
(in lora_sft, ``process_allgather`` of every host's newest uploaded step), here a barrier between the
threads. The real thing, jax.distributed processes as separate hosts, is tests/trainer/test_multihost_sft.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError
from loraflow.pipeline import artifacts, checkpoint_sync

HOSTS = 2
HANG_GUARD = 120  # seconds a broken protocol may block a thread before the test fails instead of hanging


class Collective:
    """``agree`` for each host: blocks until every host has called it, then returns every host's value."""

    def __init__(self, hosts: int) -> None:
        self.values = [0] * hosts
        self.entered = [threading.Event() for _ in range(hosts)]
        self.barrier = threading.Barrier(hosts)

    def of(self, host: int) -> Callable[[int], list[int]]:
        def agree(value: int) -> list[int]:
            self.values[host] = value
            self.entered[host].set()
            self.barrier.wait(HANG_GUARD)
            seen = list(self.values)
            self.barrier.wait(HANG_GUARD)  # nobody overwrites a value before every host has read them all
            return seen

        return agree


def _finalised_step(local: Path, step: int, host: int) -> None:
    """What Orbax leaves on a host's disk for a step: that host's own shards and the metadata."""
    (local / str(step) / "model_params" / f"ocdbt.process_{host}").mkdir(parents=True)
    (local / str(step) / "model_params" / f"ocdbt.process_{host}" / "d").write_bytes(f"{step}:{host}".encode())
    (local / str(step) / "model_params" / "_METADATA").write_text(f"meta {step}")


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test through the list
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_a_step_is_committed_once_and_only_after_every_host_uploaded_its_part(gcs_bucket: str, tmp_path: Path) -> None:
    remote = f"{gcs_bucket}/p/run-1/lora_sft/_checkpoints"
    collective = Collective(HOSTS)
    local = [tmp_path / f"host{i}" / "ckpt" for i in range(HOSTS)]
    syncers = [checkpoint_sync.HostSyncer(local[i], remote, i, HOSTS, collective.of(i), keep=2) for i in range(HOSTS)]
    for host in range(HOSTS):
        _finalised_step(local[host], 2, host)

    # Host 0 uploads its part and waits for the others: step 2 must not be committed yet.
    first, errors0 = _in_thread(syncers[0].poll)
    while not collective.entered[0].is_set() and first.is_alive():
        collective.entered[0].wait(0.05)
    assert artifacts.read_json(f"{remote}/2/host-0/{checkpoint_sync.HOST_MARKER}") is not None
    assert artifacts.read_json(f"{remote}/2/{checkpoint_sync.MARKER}") is None, "committed before host 1 uploaded"
    assert checkpoint_sync.remote_steps(remote) == []

    second, errors1 = _in_thread(syncers[1].poll)
    first.join(HANG_GUARD)
    second.join(HANG_GUARD)
    assert not first.is_alive() and not second.is_alive() and not errors0 and not errors1, (errors0, errors1)
    assert checkpoint_sync.remote_steps(remote) == [2]
    marker = artifacts.read_json(f"{remote}/2/{checkpoint_sync.MARKER}")
    assert marker["hosts"] == HOSTS
    assert set(marker["files"]) == {
        f"host-{h}/model_params/{name}" for h in range(HOSTS) for name in ("_METADATA", f"ocdbt.process_{h}/d")
    }

    # A resume on new hosts: each fetches its own part only, checked against the commit marker.
    for host in range(HOSTS):
        fresh = tmp_path / f"new{host}"
        assert checkpoint_sync.download_latest(remote, fresh, host=host, hosts=HOSTS) == 2
        files = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file())
        assert files == ["2/model_params/_METADATA", f"2/model_params/ocdbt.process_{host}/d"]
        assert (fresh / "2" / "model_params" / f"ocdbt.process_{host}" / "d").read_bytes() == f"2:{host}".encode()


def test_a_resume_never_takes_a_step_some_host_did_not_upload(gcs_bucket: str, tmp_path: Path) -> None:
    """Step 4: host 0's part uploaded, host 1's files uploaded but not its marker (it died): not committed;
    every host resumes from step 2, the newest committed one."""
    remote = f"{gcs_bucket}/ck"
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 2, host)
        checkpoint_sync.upload_host_part(tmp_path / f"h{host}", remote, 2, host, HOSTS)
    checkpoint_sync.commit_step(remote, 2, HOSTS)
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 4, host)
    checkpoint_sync.upload_host_part(tmp_path / "h0", remote, 4, 0, HOSTS)
    artifacts.upload_tree(tmp_path / "h1" / "4", f"{remote}/4/host-1")  # its files, no marker

    with pytest.raises(ArtifactError, match="host 1's part has no"):
        checkpoint_sync.commit_step(remote, 4, HOSTS)
    assert checkpoint_sync.remote_steps(remote) == [2]
    for host in range(HOSTS):
        assert checkpoint_sync.download_latest(remote, tmp_path / f"new{host}", host=host, hosts=HOSTS) == 2
    assert not (tmp_path / "new0" / "4").exists()


def test_a_checkpoint_of_n_hosts_is_refused_by_a_run_of_another_count(gcs_bucket: str, tmp_path: Path) -> None:
    """Each host's part holds the shards of that host under that host count: no other count can restore it."""
    remote = f"{gcs_bucket}/ck"
    for host in range(HOSTS):
        _finalised_step(tmp_path / f"h{host}", 2, host)
        checkpoint_sync.upload_host_part(tmp_path / f"h{host}", remote, 2, host, HOSTS)
    checkpoint_sync.commit_step(remote, 2, HOSTS)
    with pytest.raises(ArtifactError, match="written by 2 host"):
        checkpoint_sync.download_latest(remote, tmp_path / "one")
    with pytest.raises(ArtifactError, match="this run has 4"):
        checkpoint_sync.download_latest(remote, tmp_path / "four", host=0, hosts=4)
    assert not (tmp_path / "one").exists() and not (tmp_path / "four").exists()
